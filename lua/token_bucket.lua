-- Token bucket, one key per (identity, endpoint, policy version).
--
-- KEYS[1]  bucket hash: t = micro-tokens, f = refill remainder (< 10^6), ts = last admit (us)
-- ARGV[1]  capacity in micro-tokens      (10^6 .. 10^15)
-- ARGV[2]  refill in micro-tokens/second (0 .. 10^12)
-- ARGV[3]  cost of this request          (1 .. capacity)
--
-- Returns "allowed left retry reset now wait" (reply() in lua/int.lua): allowed 0/1,
-- micro-tokens left, retry-after seconds (0 when allowed, -1 when never), seconds until
-- full (-1 when never), now in microseconds, and on a denial microseconds until the cost is
-- available (-1 when not exact; 0 when allowed).
--
-- Redis TIME is the only clock. All arithmetic stays on integers below 2^53, where Lua's
-- doubles are exact: the refill of a partial second is split so that no product exceeds
-- 10^12 x 10^6 / 10^6, and the remainder of every refill is carried in `f` so that no
-- micro-token is ever lost to rounding. A denied request writes nothing.

-- MICRO, idiv, ceil_div and reply come from lua/int.lua, prepended by the gateway.

local capacity = tonumber(ARGV[1])
local rate = tonumber(ARGV[2])
local cost = tonumber(ARGV[3])

local t = redis.call('TIME')
local now = tonumber(t[1]) * MICRO + tonumber(t[2])

local state = redis.call('HMGET', KEYS[1], 't', 'f', 'ts')
local tokens = capacity
local frac = 0
if state[1] then
  tokens = tonumber(state[1])
  frac = tonumber(state[2])
  local elapsed = now - tonumber(state[3])
  if elapsed > 0 and rate > 0 then
    local secs = idiv(elapsed, MICRO)
    -- While the key lives (it expires once full), secs <= capacity / rate + 1, so the
    -- product is exact; when it reaches capacity the bucket is full, whatever the remainder.
    if secs * rate >= capacity then
      tokens = capacity
      frac = 0
    else
      local us = elapsed - secs * MICRO
      local rate_hi = idiv(rate, MICRO)
      local rate_lo = rate - rate_hi * MICRO
      local part = us * rate_lo + frac
      local carry = idiv(part, MICRO)
      local gained = secs * rate + us * rate_hi + carry
      frac = part - carry * MICRO
      tokens = tokens + gained
      if tokens >= capacity then
        tokens = capacity
        frac = 0
      end
    end
  end
end

local function until_full(left)
  if left >= capacity then return 0 end
  if rate == 0 then return -1 end
  return ceil_div(capacity - left, rate)
end

if tokens < cost then
  local retry = -1
  -- Microseconds until `cost` is there, when exact in doubles (the deficit times 10^6 must
  -- stay below 2^53, about 9000 requests); the gateway's over-limit cache uses it.
  local wait = -1
  if rate > 0 then
    retry = ceil_div(cost - tokens, rate)
    if cost - tokens < 9000000000 then
      wait = ceil_div((cost - tokens) * MICRO - frac, rate)
    end
  end
  return reply(0, tokens, retry, until_full(tokens), now, wait)
end

tokens = tokens - cost
-- string.format('%d') writes these integers exactly, and faster than Redis formats numbers.
redis.call('HSET', KEYS[1], 't', string.format('%d', tokens), 'f', frac, 'ts', string.format('%d', now))
local full = until_full(tokens)
if full > 0 then
  redis.call('EXPIRE', KEYS[1], full + 1)
elseif full < 0 then
  redis.call('PERSIST', KEYS[1])
end
return reply(1, tokens, 0, full, now, 0)

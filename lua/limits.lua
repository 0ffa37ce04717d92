-- The two algorithms as functions of one key, shared by the single-limit scripts
-- (token_bucket.lua, sliding_window.lua) and the several-limits script (limits_multi.lua).
--
-- token_bucket and sliding_window return allowed (0/1), left, retry, reset, wait (as in
-- reply() of lua/int.lua) and, when allowed, a function that writes the admitted state:
-- nothing is written until it is called, so a script can look at every limit before it
-- charges any. tb_adjust and sw_adjust add to a bucket in place (refunds and response
-- charges).
--
-- Redis TIME (`now`, microseconds) is the only clock. All arithmetic stays on integers below
-- 2^53, where Lua's doubles are exact: see the comments of each algorithm.

-- Token bucket. Hash: t = micro-tokens (negative while a response charge is being paid
-- back, down to -capacity), f = refill remainder (< 10^6), ts = last write (us), e = when
-- the key's time to live ends (Redis TIME, whole seconds; -1: it has none).
-- capacity 10^6 .. 10^15 micro-tokens, rate 0 .. 10^12 per second, cost 1 .. capacity.
-- 2^53: below it doubles are exact integers, and every number the scripts write is.
local EXACT = 9007199254740992
-- A mode past this is a refund whose charge's time is `mode - REFUND_AT` (the gateway's
-- `limiter::mode::REFUND_AT`).
local REFUND_AT = 16
local abs = math.abs

local function tb_read(key, capacity, rate, now)
  local state = redis.call('HMGET', key, 't', 'f', 'ts', 'e')
  local tokens = capacity
  local frac = 0
  local e = tonumber(state[4])
  if state[1] then
    tokens = tonumber(state[1])
    frac = tonumber(state[2])
    local ts = tonumber(state[3])
    -- Fields written by something else: past 2^53 (`inf`, `-1e300`) or `nan`, idiv's steps
    -- of one no longer move its quotient, and it loops for ever, holding Redis from every
    -- caller. The scripts write nothing near that bound.
    if not (tokens and frac and ts and abs(tokens) < EXACT and abs(frac) < EXACT
      and abs(ts) < EXACT) then
      error('a bucket field is not a number the limiter wrote')
    end
    local elapsed = now - ts
    if elapsed > 0 and rate > 0 then
      local secs = idiv(elapsed, MICRO)
      -- While the key lives (it expires once full), secs <= 2 x capacity / rate + 1, so the
      -- product is exact; when it covers the whole way to capacity the bucket is full,
      -- whatever the remainder.
      if secs * rate >= capacity - tokens then
        tokens = capacity
        frac = 0
      else
        -- The refill of the partial second is split so that no product exceeds
        -- 10^12 x 10^6 / 10^6, and its remainder is carried in `f`: no micro-token is lost
        -- to rounding.
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
    -- A bucket written under a larger capacity (a reload lowered it) holds no more than the
    -- new one, refilling or not.
    if tokens >= capacity then
      tokens = capacity
      frac = 0
    end
  end
  return tokens, frac, e
end

-- Seconds until `left` micro-tokens are `capacity` again; -1 when never.
local function tb_until_full(capacity, rate, left)
  if left >= capacity then return 0 end
  if rate == 0 then return -1 end
  return ceil_div(capacity - left, rate)
end

-- Writes `left` micro-tokens; the key expires once the bucket would be full again, or a
-- little later: a full bucket reads the same as a missing key, so a key may outlive its use
-- by up to a quarter of its time to live. That room is what saves an EXPIRE on most writes
-- (it is a sixth of a decision's cost in Redis): the time to live is set again only when the
-- bucket now needs longer than the key has (`e`, as tb_read found it).
local function tb_write(key, capacity, rate, left, frac, now, e)
  -- Every integer is handed to redis.call as text, written by format('%d'): Redis writes a
  -- Lua number with '%.17g', through the C library's floating-point printer, several times
  -- the cost.
  local ts, now_s = clock(now)
  local t = format('%d', left)
  local f = frac == 0 and '0' or format('%d', frac)
  local full = tb_until_full(capacity, rate, left)
  if full > 0 then
    if e and e >= now_s + full + 1 then
      redis.call('HSET', key, 't', t, 'f', f, 'ts', ts)
    else
      local ttl = full + 1 + max(1, idiv(full, 4))
      redis.call('HSET', key, 't', t, 'f', f, 'ts', ts, 'e', format('%d', now_s + ttl))
      redis.call('EXPIRE', key, format('%d', ttl))
    end
  elseif full < 0 then
    redis.call('HSET', key, 't', t, 'f', f, 'ts', ts, 'e', '-1')
    if e ~= -1 then redis.call('PERSIST', key) end
  else
    redis.call('HSET', key, 't', t, 'f', f, 'ts', ts)
  end
  return full
end

-- A denial's retry (seconds) and wait (microseconds) until `cost` is there.
local function tb_denial(capacity, rate, cost, tokens, frac)
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
  return retry, wait
end

local function token_bucket(key, capacity, rate, cost, now)
  local tokens, frac, e = tb_read(key, capacity, rate, now)
  if tokens < cost then
    local retry, wait = tb_denial(capacity, rate, cost, tokens, frac)
    return 0, tokens, retry, tb_until_full(capacity, rate, tokens), wait, nil
  end
  local left = tokens - cost
  return 1, left, 0, tb_until_full(capacity, rate, left), 0,
    function() return tb_write(key, capacity, rate, left, frac, now, e) end
end

-- One token-bucket decision, written when admitted; its reply(). The same as token_bucket
-- and its write, without making a function per decision (the batch script runs many).
local function tb_decide(key, capacity, rate, cost, now)
  local tokens, frac, e = tb_read(key, capacity, rate, now)
  if tokens < cost then
    local retry, wait = tb_denial(capacity, rate, cost, tokens, frac)
    return reply(0, tokens, retry, tb_until_full(capacity, rate, tokens), now, wait)
  end
  local left = tokens - cost
  return admitted(left, tb_write(key, capacity, rate, left, frac, now, e), now)
end

-- Adds `amount` micro-tokens (a refund; minus a response charge), kept within
-- -capacity .. capacity. Answers as an admission.
local function tb_adjust(key, capacity, rate, amount, now)
  local tokens, frac, e = tb_read(key, capacity, rate, now)
  local left = tokens + amount
  if left >= capacity then
    left = capacity
    frac = 0
  end
  if left < -capacity then left = -capacity end
  local full = tb_write(key, capacity, rate, left, frac, now, e)
  return 1, left, 0, full, 0
end

-- Sliding window. Hash: w = index of the current window, c = its count, p = the previous
-- window's count (requests). limit 1 .. 10^9, window 1000 .. 86400 x 10^6 us, cost 1 ..
-- limit.
--
-- The estimate is  c + p x (window - elapsed) / window; a request is admitted when the
-- estimate plus its cost stays within the limit: when the previous window's weight,
-- p x (window - elapsed) / window rounded up, is at most limit - c - cost. Such a product of
-- a count and a time reaches 10^9 x 86400 x 10^6, past the 2^53 below which a double is
-- exact: mul_div computes it in two parts. The key lives two windows.

-- floor(a x t / d) and its remainder, exactly, for integers 0 <= a < 2^30 (a count), 0 <= t
-- < 2^37 (a time in microseconds) and 0 < d < 2^37, when the quotient is below 2^53 (every
-- caller's is below the window, or it only says "past the window"): the product, up to
-- 2^67, is held as hi x 2^16 + lo, each part an integer below 2^53 (a x t_hi < 2^51, and
-- each remainder shifted by 2^16 stays below 2^53), and divided part by part as by hand.
local function mul_div(a, t, d)
  local B = 65536
  local th = floor(t / B)
  local lo = a * (t - th * B)
  local carry = floor(lo / B)
  local hi = a * th + carry
  lo = lo - carry * B
  local qh = idiv(hi, d)
  local rest = (hi - qh * d) * B + lo
  local ql = idiv(rest, d)
  return qh * B + ql, rest - ql * d
end

-- The previous window's count `p` weighted by the part of it still inside the sliding
-- window, in whole requests, rounded up: ceil(p x (window - elapsed) / window).
local function sw_weight(p, window, elapsed)
  local q, r = mul_div(p, window - elapsed, window)
  if r > 0 then q = q + 1 end
  return q
end

local function sw_read(key, window, now)
  local index = idiv(now, window)
  local elapsed = now - index * window
  local c, p = 0, 0
  local s = redis.call('HMGET', key, 'w', 'c', 'p')
  if s[1] then
    local w = tonumber(s[1])
    if w == index then
      c = tonumber(s[2])
      p = tonumber(s[3])
    elseif w == index - 1 then
      p = tonumber(s[2])
    end
    -- As tb_read: a count past 2^53 or `nan` would make idiv loop for ever.
    if not (c and p and abs(c) < EXACT and abs(p) < EXACT) then
      error('a window count is not a number the limiter wrote')
    end
  end
  return index, elapsed, c, p
end

local function sw_write(key, window, index, elapsed, c, p)
  redis.call('HSET', key, 'w', format('%d', index), 'c', format('%d', c),
    'p', format('%d', p))
  redis.call('PEXPIRE', key, format('%d', ceil_div(2 * window - elapsed, 1000)))
end

-- Microseconds from `elapsed` until the estimate admits `cost` with this window's count `c`
-- and the previous one's `p`, for a request it does not admit now.
local function sw_wait(limit, window, elapsed, c, p, cost)
  local room = limit - c - cost
  if room >= 0 then
    -- Later in this window, once the previous window's weight has decayed enough (p > 0:
    -- without it the request would be admitted now).
    return window - mul_div(room, window, p) - elapsed
  end
  -- In the next window, where this window's count becomes the previous one.
  local at = 0
  if c > 0 then
    at = window - mul_div(limit - cost, window, c)
    if at < 0 then at = 0 end
  end
  return window - elapsed + at
end

local function sliding_window(key, limit, window, cost, now)
  local index, elapsed, c, p = sw_read(key, window, now)
  local window_end = ceil_div(window - elapsed, MICRO)

  -- What the limit has left for this window's requests once the previous window's weight
  -- is taken (may be below zero).
  local room = limit - c - cost
  local weight = 0
  if room >= 0 and p > 0 then weight = sw_weight(p, window, elapsed) end
  if room >= weight then
    local count = c + cost
    local left = room - weight
    -- An admission that leaves no room for another such request says when there is again
    -- (the RateLimit fields' `t` beside `r=0`), not the window's end: the previous window's
    -- weight can refuse past it, or stop refusing long before it.
    local reset = window_end
    if left < cost then
      reset = ceil_div(sw_wait(limit, window, elapsed, count, p, cost), MICRO)
    end
    return 1, left, 0, reset, 0,
      function() sw_write(key, window, index, elapsed, count, p) end
  end

  -- Denied: the first moment the estimate admits `cost`.
  local wait = sw_wait(limit, window, elapsed, c, p, cost)
  local retry = ceil_div(wait, MICRO)
  if retry < 1 then retry = 1 end
  -- Denied: `t` is the wait too, as it is after the last room's admission.
  return 0, 0, retry, retry, wait, nil
end

-- Takes back `amount` requests (a refund) from the window they were charged in, when
-- `charged` (the charge's Redis time, microseconds; 0: not known) says which: this window's
-- count, or the previous one's when the window turned since (taken from this one, the refund
-- would make room in a window other requests filled: more than `limit` in it), or nothing
-- when it is older still (or later than now). Not known: from the current window, else from
-- the previous one.
-- Never below zero. Answers as an admission.
local function sw_adjust(key, limit, window, amount, now, charged)
  local index, elapsed, c, p = sw_read(key, window, now)
  local at = index
  if charged > 0 then at = idiv(charged, window) end
  if charged == 0 then
    if c >= amount then
      c = c - amount
    else
      p = max(0, p - (amount - c))
      c = 0
    end
  elseif at == index then
    c = max(0, c - amount)
  elseif at == index - 1 then
    p = max(0, p - amount)
  end
  -- A charge made later than Redis's now (its clock stepped back, or another node's after a
  -- failover) is in a window this one cannot see: nothing is written, which would erase it.
  if at == index or at == index - 1 then sw_write(key, window, index, elapsed, c, p) end
  local left = max(0, limit - c - sw_weight(p, window, elapsed))
  return 1, left, 0, ceil_div(window - elapsed, MICRO), 0
end

-- The `n` limits a script's arguments carry from argv[at + 2] on, four each (the kind, then
-- the single-limit script's three), as a list of {kind, a, b, cost}: lua/limits_multi.lua's,
-- one per key, and lua/batch.lua's, each limit of the batch once.
local function limits_in_argv(argv, at, n)
  local limits = {}
  for i = 1, n do
    local b = at + 1 + 4 * (i - 1)
    limits[i] = { tonumber(argv[b + 1]), tonumber(argv[b + 2]), tonumber(argv[b + 3]), tonumber(argv[b + 4]) }
  end
  return limits
end

-- Several limits of one request, decided together (lua/limits_multi.lua says what the
-- modes do): keys keys[k0 + 1 .. k0 + #limits] (KEYS, or where a batch on a Redis Cluster
-- node carries them, lua/batch.lua), each with its limit in `limits`, a list of
-- {kind, a, b, cost}. Returns one reply() group per key, joined by spaces.
-- The limit (1 .. n) `several` is at: an error there is on that limit's key, which the
-- batch script names with the error (lua/batch.lua).
local touching = 0

local function several(keys, k0, mode, limits, now)
  local n = #limits
  local out = {}
  -- A refund whose charge's time is known (lua/limits_multi.lua).
  local charged = 0
  if mode >= REFUND_AT then
    charged = mode - REFUND_AT
    mode = 1
  end

  local function arg(i, j) return limits[i][j] end
  local function key(i) return keys[k0 + i] end

  if mode == 0 or mode == 3 then
    local results = {}
    local every = true
    for i = 1, n do
      local kind, a, b, cost = arg(i, 1), arg(i, 2), arg(i, 3), arg(i, 4)
      local r
      touching = i
      if kind == 1 then
        r = { token_bucket(key(i), a, b, cost, now) }
      else
        r = { sliding_window(key(i), a, b, cost, now) }
      end
      results[i] = r
      if r[1] == 0 then every = false end
    end
    for i = 1, n do
      local r = results[i]
      touching = i
      if every and mode == 0 then
        r[6]()
      elseif r[1] == 1 then
        -- Not charged: what is there now is what it would have had before this request,
        -- and so is when a bucket is full again.
        r[2] = r[2] + arg(i, 4)
        if arg(i, 1) == 1 then r[4] = tb_until_full(arg(i, 2), arg(i, 3), r[2]) end
      end
      out[i] = reply(r[1], r[2], r[3], r[4], now, r[5])
    end
  else
    -- Each key is written as soon as it is read: where the keys were not declared (a Redis
    -- Cluster node's batch), one of them whose slot is being migrated away may be refused
    -- after another was written. Each is read first (HMGET: a command the scripts' ACL
    -- user has anyway), so that such a refusal, or a broken key, writes nothing.
    if n > 1 then
      for i = 1, n do
        touching = i
        redis.call('HMGET', key(i), 't')
      end
    end
    for i = 1, n do
      local kind, a, b, cost = arg(i, 1), arg(i, 2), arg(i, 3), arg(i, 4)
      local allowed, left, retry, reset, wait
      touching = i
      if kind == 1 then
        local amount = cost
        if mode == 2 then amount = -cost end
        allowed, left, retry, reset, wait = tb_adjust(key(i), a, b, amount, now)
      elseif mode == 1 then
        allowed, left, retry, reset, wait = sw_adjust(key(i), a, b, cost, now, charged)
      else
        local index, elapsed, c, p = sw_read(key(i), b, now)
        allowed, left, retry, reset, wait = 1, max(0, a - c), 0, ceil_div(b - elapsed, MICRO), 0
      end
      out[i] = reply(allowed, left, retry, reset, now, wait)
    end
  end
  return table.concat(out, ' ')
end

-- The text of an error met under pcall (a command's error reply, a table or its text by
-- Redis version, or the script failing on data it cannot read), on one line and led by its
-- code, so that it reads as the reply Redis would have sent; ending in " (key i)" when it
-- was met on the i-th key of a decision of several limits (`touching`, 0: not known).
local function error_text(e, at)
  if type(e) == 'table' then e = e.err or e.message or '' end
  -- One line: in a batch's answer an error's own newlines would shift every answer after it.
  e = (string.gsub(tostring(e), '\n', ' '))
  -- A command's own ERR (`value is not an integer`, on a field written by something else)
  -- reads as Redis relays an error inside a script: about the key's data, not the command.
  if not string.match(e, '^%u+ ') or string.match(e, '^ERR ') then
    e = 'ERR Error running script: ' .. e
  end
  if at > 0 then e = e .. ' (key ' .. at .. ')' end
  return e
end

-- One decision of the single-limit scripts: kind 1 token bucket (capacity, refill, cost),
-- kind 2 sliding window (limit, window, cost); writes when admitted. Returns its reply().
local function decide(kind, key, x, y, z, now)
  if kind == 1 then return tb_decide(key, x, y, z, now) end
  local allowed, left, retry, reset, wait, write = sliding_window(key, x, y, z, now)
  if write then write() end
  return reply(allowed, left, retry, reset, now, wait)
end

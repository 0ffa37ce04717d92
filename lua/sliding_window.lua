-- Sliding window, one key per (identity, endpoint, policy version).
--
-- KEYS[1]  hash: w = index of the current window, c = its count, p = the previous window's
--          count (requests)
-- ARGV[1]  limit: requests per window                (1 .. 10^9)
-- ARGV[2]  window in microseconds                    (1000 .. 86400 x 10^6)
-- ARGV[3]  cost of this request, in whole requests   (1 .. limit)
--          with limit x window <= 4 x 10^15
--
-- The estimate is  c + p x (window - elapsed) / window; a request is admitted when the
-- estimate plus its cost stays within the limit, compared multiplied by the window so that
-- everything stays an integer below 2^53 (each product is at most limit x window).
--
-- Returns "allowed left retry reset now wait" (reply() in lua/int.lua): allowed 0/1,
-- requests left, retry-after seconds (0 when allowed), seconds until the current window
-- ends, now in microseconds, microseconds until the request would be admitted (0 when
-- allowed).
-- Redis TIME is the only clock. A denied request writes nothing; the key lives two windows.

-- MICRO, idiv, ceil_div and reply come from lua/int.lua, prepended by the gateway.

local limit = tonumber(ARGV[1])
local window = tonumber(ARGV[2])
local cost = tonumber(ARGV[3])

local t = redis.call('TIME')
local now = tonumber(t[1]) * MICRO + tonumber(t[2])
local index = idiv(now, window)
local elapsed = now - index * window

local c, p = 0, 0
local s = redis.call('HMGET', KEYS[1], 'w', 'c', 'p')
if s[1] then
  local w = tonumber(s[1])
  if w == index then
    c = tonumber(s[2])
    p = tonumber(s[3])
  elseif w == index - 1 then
    p = tonumber(s[2])
  end
end

local window_end = ceil_div(window - elapsed, MICRO)

if c + cost <= limit and p * (window - elapsed) + (c + cost) * window <= limit * window then
  c = c + cost
  redis.call('HSET', KEYS[1], 'w', index, 'c', c, 'p', p)
  redis.call('PEXPIRE', KEYS[1], ceil_div(2 * window - elapsed, 1000))
  local left = idiv(limit * window - p * (window - elapsed) - c * window, window)
  return reply(1, left, 0, window_end, now, 0)
end

-- Denied: the first moment the estimate admits `cost`.
local wait
if c + cost <= limit then
  -- Later in this window, once the previous window's weight has decayed enough.
  local at = window - idiv((limit - c - cost) * window, p)
  wait = at - elapsed
else
  -- In the next window, where this window's count becomes the previous one.
  local at = 0
  if c > 0 then
    at = window - idiv((limit - cost) * window, c)
    if at < 0 then at = 0 end
  end
  wait = window - elapsed + at
end
local retry = ceil_div(wait, MICRO)
if retry < 1 then retry = 1 end
return reply(0, 0, retry, window_end, now, wait)

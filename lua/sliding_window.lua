-- Sliding window, one key per (identity, endpoint, policy version).
--
-- KEYS[1]  window hash (see sliding_window in lua/limits.lua)
-- ARGV[1]  limit: requests per window                (1 .. 10^9)
-- ARGV[2]  window in microseconds                    (1000 .. 86400 x 10^6)
-- ARGV[3]  cost of this request, in whole requests   (1 .. limit)
-- ARGV[4]  deadline in Redis's TIME, microseconds (0: none): past it, an EXPIRED error and
--          nothing written
--
-- Returns "allowed left retry reset now wait" (reply() in lua/int.lua): allowed 0/1,
-- requests left, retry-after seconds (0 when allowed), seconds until the current window
-- ends (on a denial, or an admission that leaves no room for another such request, until
-- the estimate admits one again), now in microseconds, microseconds until the request would be admitted (0 when
-- allowed). A denied request writes nothing.

-- MICRO, idiv, ceil_div, reply (lua/int.lua) and sliding_window (lua/limits.lua) are
-- prepended by the gateway.

local t = redis.call('TIME')
local now = tonumber(t[1]) * MICRO + tonumber(t[2])
if expired(ARGV[4], now) then return redis.error_reply(expiry(now)) end
local allowed, left, retry, reset, wait, write =
  sliding_window(KEYS[1], tonumber(ARGV[1]), tonumber(ARGV[2]), tonumber(ARGV[3]), now)
if write then write() end
return reply(allowed, left, retry, reset, now, wait)

-- Token bucket, one key per (identity, endpoint, policy version).
--
-- KEYS[1]  bucket hash (see token_bucket in lua/limits.lua)
-- ARGV[1]  capacity in micro-tokens      (10^6 .. 10^15)
-- ARGV[2]  refill in micro-tokens/second (0 .. 10^12)
-- ARGV[3]  cost of this request          (1 .. capacity)
-- ARGV[4]  deadline in Redis's TIME, microseconds (0: none): past it, an EXPIRED error and
--          nothing written
--
-- Returns "allowed left retry reset now wait" (reply() in lua/int.lua): allowed 0/1,
-- micro-tokens left, retry-after seconds (0 when allowed, -1 when never), seconds until
-- full (-1 when never), now in microseconds, and on a denial microseconds until the cost is
-- available (-1 when not exact; 0 when allowed). A denied request writes nothing.

-- MICRO, idiv, ceil_div, reply (lua/int.lua) and tb_decide (lua/limits.lua) are
-- prepended by the gateway.

local t = redis.call('TIME')
local now = tonumber(t[1]) * MICRO + tonumber(t[2])
if expired(ARGV[4], now) then return redis.error_reply(expiry(now)) end
return tb_decide(KEYS[1], tonumber(ARGV[1]), tonumber(ARGV[2]), tonumber(ARGV[3]), now)

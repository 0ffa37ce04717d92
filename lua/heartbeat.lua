-- Fleet heartbeat: keeps this instance in the fleet's sorted set and counts the live ones.
--
-- KEYS[1]  sorted set: member = instance id, score = expiry in Redis TIME milliseconds
-- ARGV[1]  this instance's id
-- ARGV[2]  how long a heartbeat keeps an instance alive, in milliseconds
--
-- Returns the number of live instances, this one included.

local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
local ttl = tonumber(ARGV[2])
redis.call('ZADD', KEYS[1], now + ttl, ARGV[1])
redis.call('ZREMRANGEBYSCORE', KEYS[1], '-inf', now)
redis.call('PEXPIRE', KEYS[1], 2 * ttl)
return redis.call('ZCARD', KEYS[1])

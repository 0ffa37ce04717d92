-- Fleet heartbeat: keeps this instance in the fleet's sorted set and counts the live ones.
--
-- KEYS[1]  sorted set: member = instance id, score = expiry in Redis TIME milliseconds; and
--          the member `~born`, whose score is minus the set's birth (a negative score no
--          instance's expiry has)
-- ARGV[1]  this instance's id
-- ARGV[2]  how long a heartbeat keeps an instance alive, in milliseconds
--
-- Returns the number of live instances, this one included, and the set's age in
-- milliseconds: a set younger than one heartbeat's life (a Redis that lost its data, a
-- fleet's first start) may not hold every live instance yet.

local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
local ttl = tonumber(ARGV[2])
redis.call('ZADD', KEYS[1], 'NX', -now, '~born')
-- `INCR 0` reads the score with the command the fleet's ACL already permits.
local born = -tonumber(redis.call('ZADD', KEYS[1], 'INCR', 0, '~born'))
redis.call('ZADD', KEYS[1], now + ttl, ARGV[1])
redis.call('ZREMRANGEBYSCORE', KEYS[1], 0, now)
redis.call('PEXPIRE', KEYS[1], 2 * ttl)
return {redis.call('ZCARD', KEYS[1]) - 1, math.max(0, now - born)}

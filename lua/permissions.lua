-- Which of the commands the limiter scripts run on a bucket the connection's user may not
-- run (Redis 7's ACL, as the scripts would meet it): asked once a decision met an ACL
-- refusal, and at each check while some are refused, so that decisions are not sent to fail
-- halfway, after their first write. `check --redis` asks for the other commands the gateway
-- sends too: the fleet heartbeat's and the resets' (`DELETE /limits`).
--
-- ARGV[1]  a key of the buckets' prefix (`<key_prefix>:v1:...`)
-- ARGV[2]  optional: the fleet heartbeat's key (`<key_prefix>:v1:fleet`)
-- ARGV[3]  optional, with ARGV[2]: the resets' channel (`<key_prefix>:v1:resets`)
--
-- Returns the names refused, none on a Redis without `redis.acl_check_cmd` (before 7.0).

if not redis.acl_check_cmd then return {} end
local key, refused = ARGV[1], {}
local commands = {
  {'time'}, {'hmget', key, 't'}, {'hset', key, 't', '0'}, {'expire', key, '1'},
  {'pexpire', key, '1'}, {'persist', key},
}
if ARGV[2] then
  local fleet, channel = ARGV[2], ARGV[3]
  for _, command in ipairs({
    {'zadd', fleet, '0', 'm'}, {'zremrangebyscore', fleet, '0', '1'}, {'zcard', fleet},
    {'del', key}, {'publish', channel, 'm'}, {'subscribe', channel},
  }) do
    commands[#commands + 1] = command
  end
end
for _, command in ipairs(commands) do
  if not redis.acl_check_cmd(unpack(command)) then refused[#refused + 1] = command[1] end
end
return refused

-- Which of the commands the limiter scripts run on a bucket the connection's user may not
-- run (Redis 7's ACL, as the scripts would meet it): asked once a decision met an ACL
-- refusal, and at each check while some are refused, so that decisions are not sent to fail
-- halfway, after their first write.
--
-- ARGV[1]  a key of the buckets' prefix (`<key_prefix>:v1:...`)
--
-- Returns the names refused, none on a Redis without `redis.acl_check_cmd` (before 7.0).

if not redis.acl_check_cmd then return {} end
local key, refused = ARGV[1], {}
for _, command in ipairs({
  {'time'}, {'hmget', key, 't'}, {'hset', key, 't', '0'}, {'expire', key, '1'},
  {'pexpire', key, '1'}, {'persist', key},
}) do
  if not redis.acl_check_cmd(unpack(command)) then refused[#refused + 1] = command[1] end
end
return refused

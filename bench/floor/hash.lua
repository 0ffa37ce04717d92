-- Floor: the gateway's hash (t f ts e), HMGET and HSET per decision (PEXPIRE on a new key),
-- no arithmetic.
local function prepare() return {} end
local function bucket(key, _, capacity, cost, now)
  local s = redis.call('HMGET', key, 't', 'f', 'ts', 'e')
  local left = (s[1] and tonumber(s[1]) or capacity) - cost
  local t, ts = string.format('%d', left), string.format('%d', now)
  if s[4] then
    redis.call('HSET', key, 't', t, 'f', 0, 'ts', ts)
  else
    redis.call('HSET', key, 't', t, 'f', 0, 'ts', ts, 'e', 5)
    redis.call('PEXPIRE', key, 3000)
  end
  return left
end

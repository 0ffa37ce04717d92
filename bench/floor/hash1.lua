-- Floor: a hash of one field s = "t f ts e", HGET and HSET per decision (PEXPIRE on a new
-- key).
local function prepare() return {} end
local function bucket(key, _, capacity, cost, now)
  local v = redis.call('HGET', key, 's')
  local left = (v and tonumber(string.match(v, '^(-?%d+)')) or capacity) - cost
  redis.call('HSET', key, 's', string.format('%d 0 %d 5', left, now))
  if not v then redis.call('PEXPIRE', key, 3000) end
  return left
end

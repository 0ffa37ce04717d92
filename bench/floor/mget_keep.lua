-- Floor: one string per bucket, one MGET for the batch, SET KEEPTTL per decision (PX only
-- on a new key).
local function prepare(keys) return redis.call('MGET', unpack(keys)) end
local function bucket(key, v, capacity, cost, now)
  local left = (v and tonumber(string.match(v, '^(-?%d+)')) or capacity) - cost
  if v then
    redis.call('SET', key, string.format('%d 0 %d', left, now), 'KEEPTTL')
  else
    redis.call('SET', key, string.format('%d 0 %d', left, now), 'PX', 3000)
  end
  return left
end

-- Floor: one string per bucket, one MGET for the whole batch, SET PX per decision. (Two
-- decisions of one key in a batch would need the first's write remembered; the keys here
-- are random, and the floor ignores it.)
local function prepare(keys) return redis.call('MGET', unpack(keys)) end
local function bucket(key, v, capacity, cost, now)
  local left = (v and tonumber(string.match(v, '^(-?%d+)')) or capacity) - cost
  redis.call('SET', key, string.format('%d 0 %d', left, now), 'PX', 3000)
  return left
end

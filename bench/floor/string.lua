-- Floor: one string per bucket ("t f ts"), GET and SET PX per decision.
local function prepare() return {} end
local function bucket(key, _, capacity, cost, now)
  local v = redis.call('GET', key)
  local left = (v and tonumber(string.match(v, '^(-?%d+)')) or capacity) - cost
  redis.call('SET', key, string.format('%d 0 %d', left, now), 'PX', 3000)
  return left
end

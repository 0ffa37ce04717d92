-- The batch around each layout's `bucket` (bench/redis_floor.sh appends this file to it):
-- one TIME, then each decision in order, answered as lua/batch.lua answers. ARGV holds four
-- arguments per decision (kind, capacity, rate, cost), as the gateway sends them.
local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000000 + tonumber(t[2])
local pre = prepare(KEYS)
local out = {}
for i = 1, #KEYS do
  local a = (i - 1) * 4
  local left = bucket(KEYS[i], pre[i], tonumber(ARGV[a + 2]), tonumber(ARGV[a + 4]), now)
  out[i] = string.format('1 %d 0 1 %d 0', left, now)
end
return table.concat(out, '\n')

-- The batch around each layout's `bucket` (bench/redis_floor.sh appends this file to it):
-- one TIME, then each decision in order, answered as lua/batch.lua answers. ARGV as the
-- gateway sends it (lua/batch.lua): the number of limits, each limit's four arguments (kind,
-- capacity, rate, cost), then each decision's deadline and its limit by index.
local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000000 + tonumber(t[2])
local pre = prepare(KEYS)
local limits = {}
for j = 1, tonumber(ARGV[1]) do
  local b = 1 + 4 * (j - 1)
  limits[j] = { tonumber(ARGV[b + 2]), tonumber(ARGV[b + 4]) }
end
local first = 1 + 4 * #limits
local out = {}
for i = 1, #KEYS do
  if tonumber(ARGV[first + 2 * i - 1]) < now then return redis.error_reply('EXPIRED') end
  local l = limits[tonumber(ARGV[first + 2 * i])]
  local left = bucket(KEYS[i], pre[i], l[1], l[2], now)
  out[i] = string.format('1 %d 0 1 %d 0', left, now)
end
return table.concat(out, '\n')

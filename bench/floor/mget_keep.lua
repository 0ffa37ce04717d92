-- Floor: one string per bucket, one MGET for the batch, SET KEEPTTL per decision (PX only on a new key).
local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000000 + tonumber(t[2])
local out = {}
local a = 0
local vals = redis.call('MGET', unpack(KEYS))
for i = 1, #KEYS do
  local kind = tonumber(ARGV[a + 1])
  local cap, rate, cost = tonumber(ARGV[a + 2]), tonumber(ARGV[a + 3]), tonumber(ARGV[a + 4])
  a = a + 4
  local v = vals[i]
  local tokens = cap
  if v then
    local sp = string.find(v, ' ', 1, true)
    tokens = tonumber(string.sub(v, 1, sp - 1))
    redis.call('SET', KEYS[i], string.format('%d 0 %d', tokens - cost, now), 'KEEPTTL')
  else
    redis.call('SET', KEYS[i], string.format('%d 0 %d', tokens - cost, now), 'PX', 3000)
  end
  tokens = tokens - cost
  out[i] = string.format('%d %d %d %d %d %d', 1, tokens, 0, 1, now, 0)
end
return table.concat(out, '\n')

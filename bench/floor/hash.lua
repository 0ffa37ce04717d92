-- Floor: the gateway's hash (t f ts e), HMGET and HSET per decision (PEXPIRE on a new key), no arithmetic.
local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000000 + tonumber(t[2])
local out = {}
local a = 0
for i = 1, #KEYS do
  local kind = tonumber(ARGV[a + 1])
  local cap, rate, cost = tonumber(ARGV[a + 2]), tonumber(ARGV[a + 3]), tonumber(ARGV[a + 4])
  a = a + 4
  local s = redis.call('HMGET', KEYS[i], 't', 'f', 'ts', 'e')
  local tokens = cap
  if s[1] then tokens = tonumber(s[1]) end
  tokens = tokens - cost
  if s[4] then
    redis.call('HSET', KEYS[i], 't', string.format('%d', tokens), 'f', 0, 'ts', string.format('%d', now))
  else
    redis.call('HSET', KEYS[i], 't', string.format('%d', tokens), 'f', 0, 'ts', string.format('%d', now), 'e', 5)
    redis.call('PEXPIRE', KEYS[i], 3000)
  end
  out[i] = string.format('%d %d %d %d %d %d', 1, tokens, 0, 1, now, 0)
end
return table.concat(out, '\n')

-- Floor: only TIME and the answers, no key touched.
local t = redis.call('TIME')
local out = {}
for i = 1, #KEYS do out[i] = '1 0 0 1 0 0' end
return table.concat(out, '\n')

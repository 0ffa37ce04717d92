-- Decisions that waited together for one Redis connection, decided in order in one call.
--
-- KEYS     every decision's keys, one after another
-- ARGV     every decision's arguments, one after another, each led by its kind:
--          1 token bucket, 2 sliding window: one key, then the three arguments of
--            token_bucket.lua / sliding_window.lua;
--          3 several limits: the number of keys n, then limits_multi.lua's arguments (the
--            mode and four per key).
--
-- Returns one answer per decision, joined by newlines, in their order: what the decision's
-- own script would have answered, or "E " and the error it met (a broken key's WRONGTYPE,
-- say), which fails that decision alone: the others are decided and written as usual.
-- All of them are decided at one Redis TIME.

-- MICRO, idiv, ceil_div, reply (lua/int.lua) and the algorithms, several and decide
-- (lua/limits.lua) are prepended by the gateway.

local t = redis.call('TIME')
local now = tonumber(t[1]) * MICRO + tonumber(t[2])
local out = {}
local k, a, i = 0, 0, 0
local argc = #ARGV
while a < argc do
  local kind = tonumber(ARGV[a + 1])
  local ok, answer
  if kind == 3 then
    local n = tonumber(ARGV[a + 2])
    ok, answer = pcall(several, k, n, a + 2, now)
    k = k + n
    a = a + 3 + 4 * n
  else
    ok, answer = pcall(decide, kind, KEYS[k + 1],
      tonumber(ARGV[a + 2]), tonumber(ARGV[a + 3]), tonumber(ARGV[a + 4]), now)
    k = k + 1
    a = a + 4
  end
  i = i + 1
  if ok then
    out[i] = answer
  else
    -- A command's error reply (a table, or its text, by Redis version) starts with its
    -- code; anything else is the script failing on data it cannot read.
    local e = answer
    if type(e) == 'table' then e = e.err or e.message or '' end
    -- One line per answer: an error's own newlines would shift every answer after it.
    e = (string.gsub(tostring(e), '\n', ' '))
    if string.match(e, '^%u+ ') then
      out[i] = 'E ' .. e
    else
      out[i] = 'E ERR Error running script: ' .. e
    end
  end
end
return table.concat(out, '\n')

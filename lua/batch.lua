-- Decisions that waited together for one Redis connection, decided in order in one call.
--
-- KEYS     every decision's keys, one after another
-- ARGV     the batch's limits, each sent once: their number s, then four arguments each:
--          kind (1 token bucket, 2 sliding window), then as the single-limit scripts take
--          them: capacity, refill, cost (micro-tokens) or limit, window, cost (requests).
--          Then every decision in order: a single limit is the index of its limit (1 ..
--          s), one key; several limits (lua/limits_multi.lua) are 0, the mode, their
--          number n and the index of each one's limit, n keys.
--
-- Returns one answer per decision, joined by newlines, in their order: what the decision's
-- own script would have answered, or "E " and the error it met (a broken key's WRONGTYPE,
-- say), which fails that decision alone: the others are decided and written as usual.
-- All of them are decided at one Redis TIME.

-- MICRO, idiv, ceil_div, reply (lua/int.lua) and the algorithms, limits_in_argv, several
-- and decide (lua/limits.lua) are prepended by the gateway.

local t = redis.call('TIME')
local now = tonumber(t[1]) * MICRO + tonumber(t[2])
-- A batch's decisions mostly share a few limits: each is sent and read once, and a
-- decision names its own by index.
local s = tonumber(ARGV[1])
local limits = limits_in_argv(s)
local out = {}
local k, a, i = 0, 1 + 4 * s, 0
local argc = #ARGV
while a < argc do
  local index = tonumber(ARGV[a + 1])
  local ok, answer
  if index == 0 then
    local mode, n = tonumber(ARGV[a + 2]), tonumber(ARGV[a + 3])
    local of = {}
    for j = 1, n do of[j] = limits[tonumber(ARGV[a + 3 + j])] end
    ok, answer = pcall(several, k, mode, of, now)
    k = k + n
    a = a + 3 + n
  else
    local l = limits[index]
    ok, answer = pcall(decide, l[1], KEYS[k + 1], l[2], l[3], l[4], now)
    k = k + 1
    a = a + 1
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

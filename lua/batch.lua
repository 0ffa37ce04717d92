-- Decisions that waited together for one Redis connection, decided in order in one call.
--
-- KEYS     every decision's keys, one after another
--          (On a Redis Cluster node the batch's keys may lie in several slots of the node,
--          which Redis refuses of declared keys: there the gateway declares none, and ARGV
--          starts with their number and the keys, the arguments below following them. The
--          script is then led by `#!lua flags=allow-cross-slot-keys`, and a key whose slot
--          the node does not serve (moved, or migrating) fails its own decision, which the
--          gateway sends again on its own, to follow the redirect.)
-- ARGV     the batch's limits, each sent once: their number s, then four arguments each:
--          kind (1 token bucket, 2 sliding window), then as the single-limit scripts take
--          them: capacity, refill, cost (micro-tokens) or limit, window, cost (requests).
--          Then every decision in order: its deadline in Redis's TIME (microseconds, 0:
--          none), then, for a single limit, the index of its limit (1 .. s), one key; for
--          several limits (lua/limits_multi.lua), 0, the mode, their number n and the index
--          of each one's limit, n keys.
--
-- Returns one answer per decision, joined by newlines, in their order: what the decision's
-- own script would have answered, or "E " and the error it met (a broken key's WRONGTYPE,
-- say, or EXPIRED for a decision whose deadline passed: it is not made), which fails that
-- decision alone: the others are decided and written as usual. A decision of several limits
-- whose error came from one of its keys ends it with " (key i)", i counted from 1 among its
-- own keys, so that the key named in the log is the broken one.
-- All of them are decided at one Redis TIME.

-- MICRO, idiv, ceil_div, reply (lua/int.lua) and the algorithms, limits_in_argv, several,
-- decide and error_text (lua/limits.lua) are prepended by the gateway, and where the keys
-- and arguments are: `keys` (KEYS or ARGV) and `ko` (its index before the first key), `ao`
-- (ARGV's index before the first argument above).

local t = redis.call('TIME')
local now = tonumber(t[1]) * MICRO + tonumber(t[2])
-- A batch's decisions mostly share a few limits: each is sent and read once, and a
-- decision names its own by index.
local s = tonumber(ARGV[ao + 1])
local limits = limits_in_argv(ARGV, ao, s)
local out = {}
local k, a, i = ko, ao + 1 + 4 * s, 0
local argc = #ARGV
while a < argc do
  local late = expired(ARGV[a + 1], now)
  local index = tonumber(ARGV[a + 2])
  local ok, answer
  local at = 0
  if index == 0 then
    local mode, n = tonumber(ARGV[a + 3]), tonumber(ARGV[a + 4])
    if late then
      ok, answer = false, expiry(now)
    else
      local of = {}
      for j = 1, n do of[j] = limits[tonumber(ARGV[a + 4 + j])] end
      touching = 0
      ok, answer = pcall(several, keys, k, mode, of, now)
      at = touching
    end
    k = k + n
    a = a + 4 + n
  else
    if late then
      ok, answer = false, expiry(now)
    else
      local l = limits[index]
      ok, answer = pcall(decide, l[1], keys[k + 1], l[2], l[3], l[4], now)
    end
    k = k + 1
    a = a + 2
  end
  i = i + 1
  if ok then
    out[i] = answer
  else
    out[i] = 'E ' .. error_text(answer, at)
  end
end
return table.concat(out, '\n')

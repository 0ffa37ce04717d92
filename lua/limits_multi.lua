-- Several limits of one request, decided together: one key per limit.
--
-- KEYS[i]  limit i's bucket (a token bucket or a sliding window hash, lua/limits.lua)
-- ARGV[1]  mode: 0 decide, 1 refund, 2 charge, 3 peek; 16 + T: a refund of a charge Redis
--          made at time T (microseconds), which a sliding window takes from the window it
--          was made in
-- ARGV[2 + 4(i-1) ..]  limit i: kind (1 token bucket, 2 sliding window), then as the
--          single-limit scripts take them: capacity, refill, cost (micro-tokens) or limit,
--          window, cost (requests)
-- ARGV[2 + 4n]  deadline in Redis's TIME, microseconds (0: none): past it, an EXPIRED error
--          and nothing written (a refund has none: it applies whenever it runs)
--
-- decide: the request is admitted only when every limit admits it; then every limit is
--   charged. When one denies, nothing is written at all.
-- refund: gives each limit its cost back (a request admitted here and denied by a limit
--   that lives on another Redis Cluster slot).
-- charge: takes each token bucket's cost (a cost the upstream reported), down to minus
--   its capacity; sliding windows are not charged.
-- peek: decides as decide does and writes nothing, whatever the outcome: what each limit
--   would say of the request (the items of a 429 for limits that live on another Redis
--   Cluster slot than the one that denied).
--
-- An error met on a key ends with " (key i)", i counted from 1 (lua/limits.lua, error_text).
--
-- Returns one "allowed left retry reset now wait" group per key (reply() in lua/int.lua),
-- joined by spaces, in the order of the keys. For a denied request, a limit that would have
-- admitted says allowed 1 and what it has now (nothing was taken).

-- MICRO, idiv, ceil_div, reply (lua/int.lua) and the algorithms, limits_in_argv, several
-- and error_text (lua/limits.lua) are prepended by the gateway.

local t = redis.call('TIME')
local now = tonumber(t[1]) * MICRO + tonumber(t[2])
if expired(ARGV[2 + 4 * #KEYS], now) then return redis.error_reply(expiry(now)) end
touching = 0
local ok, answer = pcall(several, KEYS, 0, tonumber(ARGV[1]), limits_in_argv(ARGV, 0, #KEYS), now)
if ok then return answer end
-- The error as Redis would have sent it, naming the key it was met on (as lua/batch.lua
-- does), so that the key the gateway logs is the broken one.
return redis.error_reply(error_text(answer, touching))

-- Several limits of one request, decided together: one key per limit.
--
-- KEYS[i]  limit i's bucket (a token bucket or a sliding window hash, lua/limits.lua)
-- ARGV[1]  mode: 0 decide, 1 refund, 2 charge
-- ARGV[2 + 4(i-1) ..]  limit i: kind (1 token bucket, 2 sliding window), then as the
--          single-limit scripts take them: capacity, refill, cost (micro-tokens) or limit,
--          window, cost (requests)
--
-- decide: the request is admitted only when every limit admits it; then every limit is
--   charged. When one denies, nothing is written at all.
-- refund: gives each limit its cost back (a request admitted here and denied by a limit
--   that lives on another Redis Cluster slot).
-- charge: takes each token bucket's cost (a cost the upstream reported), down to minus
--   its capacity; sliding windows are not charged.
--
-- Returns one "allowed left retry reset now wait" group per key (reply() in lua/int.lua),
-- joined by spaces, in the order of the keys. For a denied request, a limit that would have
-- admitted says allowed 1 and what it has now (nothing was taken).

-- MICRO, idiv, ceil_div, reply (lua/int.lua) and the algorithms (lua/limits.lua) are
-- prepended by the gateway.

local t = redis.call('TIME')
local now = tonumber(t[1]) * MICRO + tonumber(t[2])
local mode = tonumber(ARGV[1])
local n = #KEYS
local out = {}

local function arg(i, j) return tonumber(ARGV[1 + 4 * (i - 1) + j]) end

if mode == 0 then
  local results, writes = {}, {}
  local admitted = true
  for i = 1, n do
    local kind, a, b, cost = arg(i, 1), arg(i, 2), arg(i, 3), arg(i, 4)
    local r
    if kind == 1 then
      r = { token_bucket(KEYS[i], a, b, cost, now) }
    else
      r = { sliding_window(KEYS[i], a, b, cost, now) }
    end
    results[i] = r
    if r[1] == 0 then admitted = false end
  end
  for i = 1, n do
    local r = results[i]
    if admitted then
      r[6]()
    elseif r[1] == 1 then
      -- Not charged: what is there now is what it would have had before this request.
      r[2] = r[2] + arg(i, 4)
    end
    out[i] = reply(r[1], r[2], r[3], r[4], now, r[5])
  end
else
  for i = 1, n do
    local kind, a, b, cost = arg(i, 1), arg(i, 2), arg(i, 3), arg(i, 4)
    local allowed, left, retry, reset, wait
    if kind == 1 then
      local amount = cost
      if mode == 2 then amount = -cost end
      allowed, left, retry, reset, wait = tb_adjust(KEYS[i], a, b, amount, now)
    elseif mode == 1 then
      allowed, left, retry, reset, wait = sw_adjust(KEYS[i], a, b, cost, now)
    else
      local index, elapsed, c, p = sw_read(KEYS[i], b, now)
      allowed, left, retry, reset, wait = 1, math.max(0, a - c), 0, ceil_div(b - elapsed, MICRO), 0
    end
    out[i] = reply(allowed, left, retry, reset, now, wait)
  end
end
return table.concat(out, ' ')

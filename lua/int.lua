-- Integer helpers shared by the limiter scripts; the gateway prepends this file to each.
-- Lua 5.1 numbers are doubles: integers below 2^53 are exact, but '/' rounds, so every
-- division of integers goes through idiv, which corrects the rounding.

local MICRO = 1000000
-- The library functions every decision calls, as locals: a global costs two table lookups
-- a call (the library, then the function), a local none.
local floor, max, format, tonumber = math.floor, math.max, string.format, tonumber

-- floor(a / b) for non-negative integers below 2^53.
local function idiv(a, b)
  local q = floor(a / b)
  while q * b > a do q = q - 1 end
  while (q + 1) * b <= a do q = q + 1 end
  return q
end

local function ceil_div(a, b)
  local q = idiv(a, b)
  if q * b < a then q = q + 1 end
  return q
end

-- `now` (microseconds) as text and in whole seconds, made once for all the decisions of a
-- batch: they share one TIME.
local last_now, last_text, last_secs
local function clock(now)
  if now ~= last_now then
    last_now, last_text, last_secs = now, format('%d', now), idiv(now, MICRO)
  end
  return last_text, last_secs
end

-- The scripts' answer: six integers in one bulk string, "allowed left retry reset now wait".
-- One string costs Redis what a six-element array does, and the gateway far less to read.
local function reply(allowed, left, retry, reset, now, wait)
  return format('%d %d %d %d %s %d', allowed, left, retry, reset, (clock(now)), wait)
end

-- A decision's deadline (microseconds in Redis's TIME; 0 or absent: none): past it, the
-- gateway no longer waits for the answer, and the decision is not made (nothing written).
-- The answer says so with Redis's now, so the gateway reads the clock from it as well.
local function expired(deadline, now)
  deadline = tonumber(deadline)
  return deadline ~= nil and deadline > 0 and now > deadline
end

local function expiry(now)
  return 'EXPIRED ' .. (clock(now)) .. ' the decision reached Redis after its deadline; nothing was written'
end

-- reply() of an admission: three of its six numbers are constants, written as text, not
-- formatted.
local function admitted(left, reset, now)
  return format('1 %d 0 %d %s 0', left, reset, (clock(now)))
end


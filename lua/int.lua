-- Integer helpers shared by the limiter scripts; the gateway prepends this file to each.
-- Lua 5.1 numbers are doubles: integers below 2^53 are exact, but '/' rounds, so every
-- division of integers goes through idiv, which corrects the rounding.

local MICRO = 1000000

-- floor(a / b) for non-negative integers below 2^53.
local function idiv(a, b)
  local q = math.floor(a / b)
  while q * b > a do q = q - 1 end
  while (q + 1) * b <= a do q = q + 1 end
  return q
end

local function ceil_div(a, b)
  local q = idiv(a, b)
  if q * b < a then q = q + 1 end
  return q
end

-- The scripts' answer: six integers in one bulk string, "allowed left retry reset now wait".
-- One string costs Redis what a six-element array does, and the gateway far less to read.
local function reply(allowed, left, retry, reset, now, wait)
  return string.format('%d %d %d %d %d %d', allowed, left, retry, reset, now, wait)
end


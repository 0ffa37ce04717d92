-- wrk script: every request carries one of 10 000 API keys, in turn (bench/speed.sh).
-- Each thread starts at its own offset, so the connections do not walk the keys in step.
local n = 10000
local i = 0
function setup(thread)
  thread:set("offset", math.random(0, n - 1))
end
function init(args)
  i = tonumber(offset) or 0
end
function request()
  i = (i + 1) % n
  return wrk.format("GET", nil, { ["X-API-Key"] = "key-" .. i })
end

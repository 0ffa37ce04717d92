-- Floor: only TIME and the answers, no key touched.
local function prepare() return {} end
local function bucket(_, _, capacity, cost) return capacity - cost end

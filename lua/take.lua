--[[ take: hand explicitly chosen rows to a consumer once they are written in every column.

Checks and marks in one step, so a call that finds rows missing marks nothing and can be retried.

Repeating a call is harmless (the same rows are marked again; a lease gets the new deadline), so
a client may retry it after a dropped connection.

KEYS[1]     td:{NAME}:consumed:CONSUMER
KEYS[2]     td:{NAME}:gtaken:CONSUMER
KEYS[3]     td:{NAME}:leases:CONSUMER
KEYS[4..]   td:{NAME}:ready:COLUMN for each requested column
ARGV[1]     n_samples_per_prompt
ARGV[2]     lease in ms; 0 hands rows out for good
ARGV[3..]   row indexes, decimal

Returns an empty list when the rows were all written (they are now marked consumed), else the
missing cells as a flat list {column position (1 = KEYS[4]), row, column position, row, ...}.
]]
-- @include bits
-- @include leases

local bad = wrong_type(1, 2, 'string') or wrong_type(3, 3, 'zset') or wrong_type(4, #KEYS, 'string')
if bad then return redis.error_reply(bad) end

local n, lease_ms = tonumber(ARGV[1]), tonumber(ARGV[2])
local rows = numbers_from(3)
local missing = {}
for k = 4, #KEYS do
  local bits = get_bits(KEYS[k], rows)
  for i = 1, #rows do
    if bits[i] == 0 then
      missing[#missing + 1] = k - 3; missing[#missing + 1] = rows[i]
    end
  end
end
if #missing > 0 then return missing end
mark_taken(KEYS[1], KEYS[2], rows, n)
if lease_ms > 0 then lease_rows(KEYS[3], rows, now_ms() + lease_ms) end
return {}

--[[ clear: forget rows (or the whole dock): their bytes, ready marks and every consumer's marks.

KEYS[1..k]        td:{NAME}:data:COLUMN      for every column of the dock
KEYS[k+1..2k]     td:{NAME}:ready:COLUMN
KEYS[2k+1..3k]    td:{NAME}:gready:COLUMN
KEYS[3k+1..3k+m]  td:{NAME}:consumed:CONSUMER for every consumer
KEYS[3k+m+1..3k+2m]   td:{NAME}:gtaken:CONSUMER
KEYS[3k+2m+1..3k+3m]  td:{NAME}:leases:CONSUMER
KEYS[3k+3m+1..3k+4m]  td:{NAME}:redelivered:CONSUMER (reset only when every row is cleared)
ARGV[1]           k, the number of columns
ARGV[2]           m, the number of consumers
ARGV[3]           n_samples_per_prompt
ARGV[4..]         rows to clear, decimal; none clears every row

Returns the number of rows cleared from data hashes (cells, summed over columns).
]]
-- @include bits

local k, m, n = tonumber(ARGV[1]), tonumber(ARGV[2]), tonumber(ARGV[3])

if #ARGV == 3 then
  local cells = 0
  for i = 1, k do cells = cells + redis.call('HLEN', KEYS[i]) end
  redis.call('DEL', unpack(KEYS))
  return cells
end

local bad = wrong_type(1, k, 'hash') or wrong_type(k + 1, 3 * k + 2 * m, 'string')
  or wrong_type(3 * k + 2 * m + 1, 3 * k + 3 * m, 'zset')
if bad then return redis.error_reply(bad) end

local rows = numbers_from(4)
local groups = groups_of(rows, n)
local cells, fields = 0, {}
for i = 1, #rows do fields[i] = ARGV[i + 3] end
for c = 1, k do
  cells = cells + call_in_chunks('HDEL', KEYS[c], fields)
  set_bits(KEYS[k + c], rows, 0)
  set_bits(KEYS[2 * k + c], groups, 0)   -- a group missing a row is no longer complete
end
for u = 1, m do
  local consumed, gtaken, leases = KEYS[3 * k + u], KEYS[3 * k + m + u], KEYS[3 * k + 2 * m + u]
  call_in_chunks('ZREM', leases, fields)
  give_back(consumed, gtaken, rows, n)
end
return cells

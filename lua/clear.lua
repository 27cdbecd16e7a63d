--[[ clear: forget rows (or the whole dock): their bytes, ready marks and every consumer's marks.

Readers that were handed the rows before the clear see it at their read (the epoch or the rows'
generations changed, see include/generations.lua) and never get the bytes written after it. Leases of
the rows end with them, so an ack from before the clear releases nothing written since.

KEYS[1]           td:{NAME}:meta
KEYS[2]           td:{NAME}:epoch                bumped by a whole clear
KEYS[3]           td:{NAME}:gen                  bumped for each row of a partial clear
KEYS[4..k+3]      td:{NAME}:data:COLUMN          for every column of the dock
KEYS[k+4..2k+3]   td:{NAME}:ready:COLUMN
KEYS[2k+4..3k+3]  td:{NAME}:gready:COLUMN
then, for every consumer, m keys of each kind in this order:
                  td:{NAME}:consumed:CONSUMER, td:{NAME}:gtaken:CONSUMER, td:{NAME}:leases:CONSUMER,
                  td:{NAME}:tokens:CONSUMER, td:{NAME}:redelivered:CONSUMER (reset only by a whole clear)
then              td:{NAME}:len:COLUMN for each of the L length columns
then              the batch's own keys, td:{NAME}:cursor and td:{NAME}:metrics (reset only by a whole
                  clear: they belong to the batch, not to rows)
ARGV[1]           the schema the client expects (see include/schema.lua)
ARGV[2]           k, the number of columns
ARGV[3]           m, the number of consumers
ARGV[4]           n_samples_per_prompt
ARGV[5]           L, the number of length columns
ARGV[6..]         rows to clear, decimal; none clears every row

Returns the number of rows cleared from data hashes (cells, summed over columns).
]]
-- @include bits
-- @include schema
-- @include leases
-- @include generations

local wrong_schema = schema_error(KEYS[1], ARGV[1])
if wrong_schema then return redis.error_reply(wrong_schema) end
local k, m, n = tonumber(ARGV[2]), tonumber(ARGV[3]), tonumber(ARGV[4])
local data, ready, gready = 3, 3 + k, 3 + 2 * k         -- KEYS[data + c] is column c's data hash
local consumed, gtaken, leases, tokens = 3 + 3 * k, 3 + 3 * k + m, 3 + 3 * k + 2 * m, 3 + 3 * k + 3 * m
local redelivered = 3 + 3 * k + 4 * m
local nlen = tonumber(ARGV[5])
local len_keys = 3 + 3 * k + 5 * m      -- KEYS[len_keys + j] is the j-th length column's array

if #ARGV == 5 then
  local bad = wrong_type(2, 2, 'string')
  if bad then return redis.error_reply(bad) end
  local cells = 0
  for c = 1, k do
    if redis.call('TYPE', KEYS[data + c])['ok'] == 'hash' then cells = cells + redis.call('HLEN', KEYS[data + c]) end
  end
  redis.call('DEL', unpack(KEYS, 4))
  redis.call('INCR', KEYS[2])
  return cells
end

local bad = wrong_type(2, 3, 'string') or wrong_type(data + 1, data + k, 'hash')
  or wrong_type(ready + 1, gtaken + m, 'string') or wrong_type(leases + 1, leases + m, 'zset')
  or wrong_type(tokens + 1, tokens + m, 'hash') or wrong_type(len_keys + 1, len_keys + nlen, 'string')
if bad then return redis.error_reply(bad) end

local rows = numbers_from(6)
local groups = groups_of(rows, n)
local cells, fields, zeros = 0, {}, {}
for i = 1, #rows do fields[i] = ARGV[i + 5]; zeros[i] = 0 end
bump_generations(KEYS[3], rows)
for c = 1, k do
  cells = cells + call_in_chunks('HDEL', KEYS[data + c], fields)
  set_bits(KEYS[ready + c], rows, 0)
  set_bits(KEYS[gready + c], groups, 0)   -- a group missing a row is no longer complete
end
for j = 1, nlen do
  if redis.call('EXISTS', KEYS[len_keys + j]) == 1 then set_u32(KEYS[len_keys + j], rows, zeros) end
end
for u = 1, m do
  drop_leases(KEYS[leases + u], KEYS[tokens + u], fields)
  give_back(KEYS[consumed + u], KEYS[gtaken + u], rows, n)
end
return cells

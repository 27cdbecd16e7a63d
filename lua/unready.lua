--[[ unready: mark rows of some columns not ready, keeping their bytes (the TransferQueue's
clear_data_status: a response being continued must not be read as final by anyone).

KEYS[1]       td:{NAME}:meta
KEYS[2i]      td:{NAME}:ready:COLUMN_i
KEYS[2i+1]    td:{NAME}:gready:COLUMN_i
ARGV[1]       the schema the client expects (see include/schema.lua)
ARGV[2]       n_samples_per_prompt
ARGV[3..]     the rows, decimal

Returns how many of the cells were ready.
]]
-- @include bits
-- @include schema

local wrong_schema = schema_error(KEYS[1], ARGV[1])
if wrong_schema then return redis.error_reply(wrong_schema) end
local bad = wrong_type(2, #KEYS, 'string')
if bad then return redis.error_reply(bad) end
local rows = numbers_from(3)
local groups = groups_of(rows, tonumber(ARGV[2]))
local was = 0
for k = 2, #KEYS, 2 do
  for _, bit in ipairs(get_bits(KEYS[k], rows)) do was = was + bit end
  set_bits(KEYS[k], rows, 0)
  set_bits(KEYS[k + 1], groups, 0)
end
return was

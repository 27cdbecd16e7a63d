--[[ prefetch: hand out the next `count` row indexes of the batch to a rollout rank (MindSpeed's
prefetch_request_index): many ranks calling at once never get the same row.

KEYS[1]     td:{NAME}:meta
KEYS[2]     td:{NAME}:cursor    the next row to hand out (reset by a whole clear)
ARGV[1]     the schema the client expects (see include/schema.lua)
ARGV[2]     count
ARGV[3]     capacity (rows in the dock)

Returns {} when the cursor has passed the last row, else {first, stop}: rows [first, stop), which is
shorter than count at the end of the dock. The cursor moves by count either way, as MindSpeed's does.
]]
-- @include bits
-- @include schema

local wrong_schema = schema_error(KEYS[1], ARGV[1])
if wrong_schema then return redis.error_reply(wrong_schema) end
local bad = wrong_type(2, 2, 'string')
if bad then return redis.error_reply(bad) end
local count, capacity = tonumber(ARGV[2]), tonumber(ARGV[3])
local first = tonumber(redis.call('GET', KEYS[2]) or '0')
if not first then return redis.error_reply('CORRUPT ' .. KEYS[2] .. ' holds no integer') end
if first >= capacity then return {} end
redis.call('INCRBY', KEYS[2], count)
return {first, math.min(first + count, capacity)}

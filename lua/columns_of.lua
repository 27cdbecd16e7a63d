--[[ columns_of: record which columns consumers read when get_experience is given none
(MindSpeed TransferQueue's register_consumer_columns_dict). One field per consumer, so two workers
registering different consumers at once both stay.

KEYS[1]     td:{NAME}:meta
KEYS[2]     td:{NAME}:columns_of    hash: consumer -> JSON list of columns
ARGV[1]     the schema the client expects (see include/schema.lua)
ARGV[2..]   consumer, JSON list, consumer, JSON list, ...

Returns the number of consumers recorded.
]]
-- @include bits
-- @include schema

local wrong_schema = schema_error(KEYS[1], ARGV[1])
if wrong_schema then return redis.error_reply(wrong_schema) end
local bad = wrong_type(2, 2, 'hash')
if bad then return redis.error_reply(bad) end
for i = 2, #ARGV, 2 do redis.call('HSET', KEYS[2], ARGV[i], ARGV[i + 1]) end
return (#ARGV - 1) / 2

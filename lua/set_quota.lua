--[[ set_quota: set or remove a dock's byte quota, counting the bytes the dock holds (see include/quota.lua).

Counted here once, atomically, over every field of the dock's data and tail hashes; from then on the
scripts that write or delete values keep the count. A quota below what the dock holds is set as asked:
puts are refused until clears bring the count under it. A sharded dock is refused by the client (its
bytes are on other slots).

KEYS[1]     td:{NAME}:meta
KEYS[2..]   td:{NAME}:data:COLUMN and td:{NAME}:tail:COLUMN, of every column
ARGV[1]     the schema the client expects (see include/schema.lua)
ARGV[2]     the quota in bytes, or "" to remove it (and the count)

Returns the bytes the dock holds.
]]
-- @include bits
-- @include schema
-- @include quota

local wrong_schema = schema_error(KEYS[1], ARGV[1])
if wrong_schema then return redis.error_reply(wrong_schema) end
local bad = wrong_type(2, #KEYS, 'hash')
if bad then return redis.error_reply(bad) end
local stored = 0
for k = 2, #KEYS do stored = stored + stored_in(KEYS[k], redis.call('HKEYS', KEYS[k])) end
if ARGV[2] == '' then
  redis.call('HDEL', KEYS[1], 'quota_bytes', 'stored_bytes')
else
  redis.call('HSET', KEYS[1], 'quota_bytes', ARGV[2], 'stored_bytes', stored)
end
return stored

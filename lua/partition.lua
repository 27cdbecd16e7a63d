--[[ partition: record the partitions of a partitioned dock NAME unless a dock of that name exists; either
way return what is recorded.

Atomic on NAME's slot, as lua/create.lua is, so that two processes making the same dock at once agree on one
set of partitions, and a dock of one partition and a partitioned dock are never both made under one name:
create.lua refuses where this record is, and this script where a dock's meta is. The partitions themselves
are docks made before (each with create.lua, in its own slot): a record names only partitions that exist.

KEYS[1]     td:{NAME}:meta           a dock of one partition named NAME
KEYS[2]     td:{NAME}:partitions     the record: JSON, see broker/api/partitioned.py
ARGV[1]     the record to store

Returns {1} when it stored the record, {2} when NAME is a dock of one partition, else {0, record stored}.
A resend after a lost reply finds its own record and compares equal: no kept reply is needed.
]]

if redis.call('EXISTS', KEYS[1]) == 1 then return {2} end
local stored = redis.call('GET', KEYS[2])
if stored then return {0, stored} end
redis.call('SET', KEYS[2], ARGV[1])
return {1}

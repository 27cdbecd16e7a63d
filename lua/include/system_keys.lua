--[[ system_keys: whether the keys a client listed for a dock (and a TransferQueue system on it) are still all of
them, pasted in by `-- @include system_keys` (snapshot.lua, restore.lua).

The client names every key of the system (the dock's from its schema, the partitions' from their hash, the
named takes' records from their index) rather than a script scanning the keyspace (workers are not granted
SCAN, and a scan walks every tenant's keys). A partition made or a record written after the client read them
would be a key it did not name: the script compares what it reads now with what the client read, and the
client reads again and retries on a mismatch.
]]

-- True if `partitions_key` (a hash) holds exactly the ARGV[first+1 .. first+P] partitions (P = ARGV[first])
-- and `records_key` (a sorted set) exactly the R records that follow them (R = ARGV[first+1+P], then their
-- names); also returns the index of the first ARGV after them.
local function listed_keys_current(partitions_key, records_key, first)
  local partitions = tonumber(ARGV[first])
  if redis.call('HLEN', partitions_key) ~= partitions then return false end
  for i = first + 1, first + partitions do
    if redis.call('HEXISTS', partitions_key, ARGV[i]) == 0 then return false end
  end
  local at = first + 1 + partitions
  local records = tonumber(ARGV[at])
  if redis.call('ZCARD', records_key) ~= records then return false end
  for i = at + 1, at + records do
    if not redis.call('ZSCORE', records_key, ARGV[i]) then return false end
  end
  return true, at + records + 1
end

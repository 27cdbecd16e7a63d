--[[ listed_keys: whether the keys a client listed for a dock (and for a slice's keys beside it, such as a
TransferQueue system's) are still all of them, pasted in by `-- @include listed_keys` (snapshot.lua,
restore.lua).

The client names every key rather than a script scanning the keyspace (workers are not granted SCAN, and a
scan walks every tenant's keys): the dock's from its schema, and the others from indexes it read: the named
takes' records from their sorted set, a slice's keys from the index it keeps (a TransferQueue system's
partitions hash). A key made after the client read an index would be one it did not name: the script compares
each index now with what the client read, and the client reads again and retries on a mismatch.
]]

-- True if each of the I indexes KEYS[first_key .. first_key+I-1] (a hash or a sorted set; absent: empty)
-- holds exactly the members the client read: ARGV[first] = I, then per index its member count M and its M
-- members. Also returns the index of the first ARGV after them.
local function listed_keys_current(first_key, first)
  local indexes = tonumber(ARGV[first])
  local at = first + 1
  for i = first_key, first_key + indexes - 1 do
    local kind = redis.call('TYPE', KEYS[i])['ok']
    local count = tonumber(ARGV[at])
    local size = 0
    if kind == 'hash' then
      size = redis.call('HLEN', KEYS[i])
    elseif kind == 'zset' then
      size = redis.call('ZCARD', KEYS[i])
    elseif kind ~= 'none' then
      return false
    end
    if size ~= count then return false end
    for j = at + 1, at + count do
      local found
      if kind == 'hash' then
        found = redis.call('HEXISTS', KEYS[i], ARGV[j]) == 1
      else
        found = redis.call('ZSCORE', KEYS[i], ARGV[j])
      end
      if not found then return false end
    end
    at = at + 1 + count
  end
  return true, at
end

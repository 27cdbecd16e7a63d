--[[ snapshot: copy every key of a dock, in one step, for a checkpoint (broker/api/snapshot.py: a run's
checkpoint in workers/, and broker.transfer_queue's save_checkpoint).

The dock keeps its bytes in its slot (shards=0), and a TransferQueue system's keys are beside it, so every
key is in this slot and one script sees all of them at one moment: no row half put, half cleared or half
taken. The copies (COPY, in the same slot) are what the client then reads at leisure, in parts of bounded
size, while writers and readers go on with the originals; it deletes them when done, and they expire by
themselves if it dies first.

Which keys exist is what the client read before (the dock's schema, the named takes' records, and the keys of
a slice beside the dock, such as a TransferQueue system's partitions): keys are named by the client, never
built here. The script checks that the indexes it read them from still list the same (include/listed_keys.lua),
and answers {0} when they do not (a named take or a partition was added or dropped since), so the client
reads again and retries; a grown schema fails the schema check, and the client adopts it and retries.

KEYS[1]             td:{NAME}:meta
KEYS[2..1+I]        the indexes the keys were listed from: td:{NAME}:named (the named takes' records, a sorted
                    set), then a slice's (a TransferQueue system's td:{NAME}:tq:partitions, a hash)
KEYS[2+I..1+I+N]    every key to copy (the dock's, its named takes' records, a slice's), the meta included
KEYS[2+I+N..1+I+2N] where to copy each (DockKeys.staged), in the same order
ARGV[1]             the schema the client expects (see include/schema.lua)
ARGV[2]             N
ARGV[3]             how long the copies live, in ms (the client deletes them sooner)
ARGV[4]             I; then per index the number of members the client read, and those members

Returns {1, now, type_1, pttl_1, ..., type_N, pttl_N}: the server's time (ms), then per key its type
("none": it did not exist, and was not copied) and its time to live in ms (-1: none); or {0} if an index
does not list what the client read.
]]
-- @include schema
-- @include listed_keys
-- @include leases

local wrong_schema = schema_error(KEYS[1], ARGV[1])
if wrong_schema then return redis.error_reply(wrong_schema) end

local n, ttl = tonumber(ARGV[2]), tonumber(ARGV[3])
if not listed_keys_current(2, 4) then return {0} end
local first = 2 + tonumber(ARGV[4])  -- the first key to copy

for i = first + n, first + 2 * n - 1 do  -- before the first write: a script is not rolled back
  if redis.call('EXISTS', KEYS[i]) == 1 then
    return redis.error_reply('ERR ' .. KEYS[i] .. ' exists already: a checkpoint run id used twice')
  end
end

local out = {1, now_ms()}
for i = first, first + n - 1 do
  local t = redis.call('TYPE', KEYS[i])['ok']
  out[#out + 1] = t
  if t == 'none' then
    out[#out + 1] = -1
  else
    out[#out + 1] = redis.call('PTTL', KEYS[i])
    redis.call('COPY', KEYS[i], KEYS[i + n])
    redis.call('PEXPIRE', KEYS[i + n], ttl)
  end
end
return out

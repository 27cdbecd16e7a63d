--[[ snapshot: copy every key of a dock, in one step, for a checkpoint (broker/api/snapshot.py: a run's
checkpoint in workers/, and broker.transfer_queue's save_checkpoint).

The dock keeps its bytes in its slot (shards=0), and a TransferQueue system's keys are beside it, so every
key is in this slot and one script sees all of them at one moment: no row half put, half cleared or half
taken. The copies (COPY, in the same slot) are what the client then reads at leisure, in parts of bounded
size, while writers and readers go on with the originals; it deletes them when done, and they expire by
themselves if it dies first.

Which keys exist is what the client read before (the dock's schema, the partitions, the named takes'
records): keys are named by the client, never built here. The script checks that this is still so, and
answers {0} when it is not (a partition or a named take was added or dropped since), so the client reads
again and retries; a grown schema fails the schema check, and the client adopts it and retries.

KEYS[1]         td:{NAME}:meta
KEYS[2]         td:{NAME}:tq:partitions   partition -> when created, a hash
KEYS[3]         td:{NAME}:named           the named takes' records, a sorted set
KEYS[4..3+N]    every key the system may have (DockKeys.tq_system: the dock's, and the adapter's if any), the meta and the two above included
KEYS[4+N..3+2N] where to copy each (DockKeys.staged), in the same order
ARGV[1]         the schema the client expects (see include/schema.lua)
ARGV[2]         N
ARGV[3]         how long the copies live, in ms (the client deletes them sooner)
ARGV[4]         P, the number of partitions the client read; ARGV[5..4+P] the partitions
ARGV[5+P]       R, the number of named takes' records the client read (they are among KEYS[4..3+N])
ARGV[6+P..5+P+R] those records' keys

Returns {1, now, type_1, pttl_1, ..., type_N, pttl_N}: the server's time (ms), then per key its type
("none": it did not exist, and was not copied) and its time to live in ms (-1: none); or {0} if the
partitions or the records are not those the client read.
]]
-- @include schema
-- @include system_keys
-- @include leases

local wrong_schema = schema_error(KEYS[1], ARGV[1])
if wrong_schema then return redis.error_reply(wrong_schema) end

local n, ttl = tonumber(ARGV[2]), tonumber(ARGV[3])
if not listed_keys_current(KEYS[2], KEYS[3], 4) then return {0} end

for i = 4 + n, 3 + 2 * n do  -- before the first write: a script is not rolled back
  if redis.call('EXISTS', KEYS[i]) == 1 then
    return redis.error_reply('ERR ' .. KEYS[i] .. ' exists already: a checkpoint run id used twice')
  end
end

local out = {1, now_ms()}
for i = 4, 3 + n do
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

--[[ restore: replace every key of a dock (and of a TransferQueue system on it) by those a checkpoint holds, in
one step (broker/api/snapshot.py: a resumed run in workers/, and broker.transfer_queue's load_checkpoint).

The client has written the checkpoint's keys beside the system first (DockKeys.staged: in the dock's
slot, expiring if it dies), in as many parts as their size needs; this script then deletes every key the
system has and renames the staged keys to their names, and writes the meta: nobody sees a system half
restored. The meta comes in ARGV rather than staged: it is the checkpoint's, grown by the columns and
tasks the system has now, so a process that knows those finds its schema inside the restored one and
goes on (a dock adopts a grown schema at its next call).

Forward, never back: the rows come back as saved, but no delivery handed out before the restore (before
the save or after it) may name them again (include/delivery.lua). Put back, the saved epoch and
generations would match a delivery handed out after the save once the next clear counted the epoch up
to its value again, and its late put would land on the next prompts' rows. So the epoch becomes greater
than both the one the dock had and the saved one (at least the server's time in microseconds, as a new
dock's, see create.lua): every delivery from before the restore is fenced off, whatever the rows'
generations (a write, a read's check and a give-back compare the epoch first), and clears count up from
there. The rows' bytes stay where they are: a checkpoint is of a dock that keeps them in its slot, under
field ROW, not in a data shard's hash named by the epoch (snapshot.lua). The restored leases keep their
deadlines, so their rows come back when those pass, but under tokens no delivery has (the old token and
"~EPOCH"): an ack from before the restore releases nothing, as its put lands nothing.

Which keys the system has is what the client read (its schema, named takes' records, and the keys of a slice
beside the dock, such as a TransferQueue system's partitions): keys are named by the client, never built
here. The script checks that the indexes it read them from still list the same (include/listed_keys.lua) and
answers {0} when they do not, so the client reads again and retries; a grown schema fails the schema check,
and the client adopts it and retries.

KEYS[1]                 td:{NAME}:meta
KEYS[2]                 td:{NAME}:epoch (among the keys below too)
KEYS[3..2+I]            the indexes the keys were listed from (as in snapshot.lua)
KEYS[3+I..2+I+C]        every key the system may have now: all deleted
KEYS[3+I+C..2+I+C+S]    the staged keys (DockKeys.staged)
then S keys             the name each takes, in the same order
then T keys             td:{NAME}:tokens:CONSUMER of every consumer of the restored meta: leases' tokens
ARGV[1]                 the schema the client expects (see include/schema.lua)
ARGV[2]                 C
ARGV[3]                 S
ARGV[4]                 T
ARGV[5]                 I; then per index the number of members the client read, and those members
then S values           when each restored key expires, ms of server time (-1: never); a time passed deletes it
then M                  twice the number of meta fields; then M values: field, value, ...

Returns {1, S, epoch}: the keys restored and the dock's epoch now; {0} if an index does not list what the
client read; an error naming a staged key that is gone (its time ran out: the load took
longer than the staging lasts), before anything changed.

last            how long to keep the reply, in ms; and td:{NAME}:reply:REQUEST_ID as the last key
                (include/once.lua): a resend after a lost reply must not find the staged keys gone
]]
-- @include bits
-- @include schema
-- @include listed_keys
-- @include once

local reply_key, reply_ttl = once_args()
local kept = kept_reply(reply_key)
if kept then return kept end

local wrong_schema = schema_error(KEYS[1], ARGV[1])
if wrong_schema then return redis.error_reply(wrong_schema) end

local current, staged, tokens = tonumber(ARGV[2]), tonumber(ARGV[3]), tonumber(ARGV[4])
local current_keys, deadlines = listed_keys_current(3, 5)
if not current_keys then return {0} end
local first_current = 3 + tonumber(ARGV[5])
local first_stage = first_current + current
for i = first_stage, first_stage + staged - 1 do  -- before the first write: a script is not rolled back
  if redis.call('EXISTS', KEYS[i]) == 0 then
    return redis.error_reply('ERR ' .. KEYS[i] .. ' is gone: the checkpoint load took longer than its staged '
      .. 'keys live, or another process deleted them; load it again')
  end
end

-- The epoch in `key`; 0 for none, or for one that is not a number (it is replaced below, whatever it is).
local function epoch_in(key)
  if redis.call('TYPE', key)['ok'] ~= 'string' then return 0 end
  return tonumber(redis.call('GET', key)) or 0
end

local epoch_before = epoch_in(KEYS[2])
for i = first_current, first_stage - 1 do redis.call('DEL', KEYS[i]) end
for j = 0, staged - 1 do
  local target = KEYS[first_stage + staged + j]
  redis.call('RENAME', KEYS[first_stage + j], target)
  local deadline = tonumber(ARGV[deadlines + j])
  if deadline < 0 then
    redis.call('PERSIST', target)
  else
    redis.call('PEXPIREAT', target, deadline)
  end
end
local meta_at = deadlines + staged
local fields = tonumber(ARGV[meta_at])
for i = meta_at + 1, meta_at + fields, 2 do
  redis.call('HSET', KEYS[1], ARGV[i], ARGV[i + 1])
end

-- Forward, never back (see above): past the epoch the dock had, the saved one, and the server's time.
local t = redis.call('TIME')
local epoch = math.max(tonumber(t[1]) * 1000000 + tonumber(t[2]), epoch_before + 1, epoch_in(KEYS[2]) + 1)
redis.call('SET', KEYS[2], int_text(epoch))
local suffix = '~' .. int_text(epoch)
for i = first_stage + 2 * staged, first_stage + 2 * staged + tokens - 1 do
  if redis.call('TYPE', KEYS[i])['ok'] == 'hash' then  -- another type is the scripts' CORRUPT error later
    local held = redis.call('HGETALL', KEYS[i])
    for v = 2, #held, 2 do held[v] = string.match(held[v], '^[^~]*') .. suffix end
    for first = 1, #held, UNPACK_CHUNK do  -- an even count: field, value pairs
      redis.call('HSET', KEYS[i], unpack(held, first, math.min(first + UNPACK_CHUNK - 1, #held)))
    end
  end
end
return keep_reply(reply_key, reply_ttl, {1, staged, epoch})

--[[ create: store a dock's schema unless a dock of that name exists; either way return what is stored.

Atomic, so two processes creating the same dock at once agree on one schema.

A new dock's epoch (include/generations.lua) starts at the server's time in microseconds, not at 0: a
delivery fences a put by the epoch and the rows' generations it was handed out under, and a dock deleted
and made again under the same name must not take an old delivery of the one before for its own (it would
let a late worker's put land on the new dock's prompts). Whole clears count up from there.

KEYS[1]     td:{NAME}:meta
KEYS[2]     td:{NAME}:epoch
KEYS[3]     td:{NAME}:partitions     the record of a partitioned dock NAME (lua/partition.lua): then no dock of
                                     one partition may be made under its name
ARGV        field, value, field, value, ... of the schema to store

Returns {1} when it stored the schema, {2, record} when NAME is a partitioned dock, else
{0, field, value, ...} of the schema already there.

last        how long to keep the reply, in ms; and td:{NAME}:reply:REQUEST_ID as the last key
            (include/once.lua): a resend after a lost reply still says the call created the dock
]]
-- @include once

local reply_key, reply_ttl = once_args()
local kept = kept_reply(reply_key)
if kept then return kept end

local record = redis.call('GET', KEYS[3])
if record then return {2, record} end
if redis.call('EXISTS', KEYS[1]) == 1 then
  local stored = redis.call('HGETALL', KEYS[1])
  table.insert(stored, 1, 0)
  return stored
end
redis.call('HSET', KEYS[1], unpack(ARGV))
local t = redis.call('TIME')
redis.call('SET', KEYS[2], t[1] .. string.format('%06d', tonumber(t[2])))
return keep_reply(reply_key, reply_ttl, {1})

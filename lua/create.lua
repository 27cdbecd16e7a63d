--[[ create: store a dock's schema unless a dock of that name exists; either way return what is stored.

Atomic, so two processes creating the same dock at once agree on one schema.

KEYS[1]     td:{NAME}:meta
ARGV        field, value, field, value, ... of the schema to store

Returns {1} when it stored the schema, else {0, field, value, ...} of the schema already there.

last        how long to keep the reply, in ms; and td:{NAME}:reply:REQUEST_ID as the last key
            (include/once.lua): a resend after a lost reply still says the call created the dock
]]
-- @include once

local reply_key, reply_ttl = once_args()
local kept = kept_reply(reply_key)
if kept then return kept end

if redis.call('EXISTS', KEYS[1]) == 1 then
  local stored = redis.call('HGETALL', KEYS[1])
  table.insert(stored, 1, 0)
  return stored
end
redis.call('HSET', KEYS[1], unpack(ARGV))
return keep_reply(reply_key, reply_ttl, {1})

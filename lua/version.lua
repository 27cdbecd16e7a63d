--[[ version: set the dock's current policy version (the trainer, after each weight update).

Versions only grow: a trainer restarted from an older checkpoint, or two trainers, would otherwise
make rows look fresher than they are and let stale rows through the staleness bound. It also marks the
meta (field "versioned"): a version key missing after that was lost, not unset (include/current_version.lua).

KEYS[1]     td:{NAME}:meta
KEYS[2]     td:{NAME}:version
ARGV[1]     the schema the client expects (see include/schema.lua)
ARGV[2]     the new version, an integer in [0, 2^53), in decimal

Returns the version now set, or a VERSION error naming the stored one if the new one is lower (LOST if
the stored one was lost: then no one knows whether the new one is lower).
]]
-- @include bits
-- @include schema
-- @include current_version

local wrong_schema = schema_error(KEYS[1], ARGV[1])
if wrong_schema then return redis.error_reply(wrong_schema) end
local bad = wrong_type(2, 2, 'string')
if bad then return redis.error_reply(bad) end
local now, lost = current_version(KEYS[1], KEYS[2])
if not now then return redis.error_reply(lost) end
-- Compared as numbers, exact below 2^53 (the client refuses larger versions); stored and reported as
-- the client's text: Lua would write 16 digits as 1.7e+15.
local v = tonumber(ARGV[2])
if v < now then
  return redis.error_reply('VERSION ' .. KEYS[2] .. ' is at version ' .. int_text(now) .. '; versions only grow, got '
    .. ARGV[2])
end
redis.call('SET', KEYS[2], ARGV[2])
redis.call('HSET', KEYS[1], 'versioned', '1')  -- not a schema field: the scripts' schema check skips it
return v

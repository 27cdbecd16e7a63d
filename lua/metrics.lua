--[[ metrics: update metrics every worker of a dock shares (MindSpeed's Metric.update), atomically.

Each value is JSON text, made by the client: a number, or a list of numbers. Appending is string
work on that text (Redis Lua has cjson, but fakeredis has none), so many workers appending to one
metric at once lose nothing.

KEYS[1]     td:{NAME}:meta
KEYS[2]     td:{NAME}:metrics    hash: metric name -> JSON value
ARGV[1]     the schema the client expects (see include/schema.lua)
ARGV[2]     "set" (replace each value) or "append" (extend a stored list with a list; a stored number,
            or no value, is replaced by the list, as MindSpeed's Metric does)
ARGV[3..]   name, JSON value, name, JSON value, ...; with "append" every value is a JSON list

Returns the number of metrics written.

last        how long to keep the reply, in ms; and td:{NAME}:reply:REQUEST_ID as the last key
            (include/once.lua): a resend after a lost reply appends nothing twice
]]
-- @include bits
-- @include schema
-- @include once

local reply_key, reply_ttl = once_args()
local kept = kept_reply(reply_key)
if kept then return kept end

local wrong_schema = schema_error(KEYS[1], ARGV[1])
if wrong_schema then return redis.error_reply(wrong_schema) end
local bad = wrong_type(2, 2, 'hash')
if bad then return redis.error_reply(bad) end
local append = ARGV[2] == 'append'
for i = 3, #ARGV, 2 do
  local name, value = ARGV[i], ARGV[i + 1]
  if append then
    local stored = redis.call('HGET', KEYS[2], name)
    if stored and string.sub(stored, 1, 1) == '[' and value ~= '[]' then
      if stored == '[]' then
        stored = value
      else
        stored = string.sub(stored, 1, -2) .. ',' .. string.sub(value, 2)
      end
      value = stored
    elseif stored and string.sub(stored, 1, 1) == '[' then
      value = stored
    end
  end
  redis.call('HSET', KEYS[2], name, value)
end
return keep_reply(reply_key, reply_ttl, (#ARGV - 2) / 2)

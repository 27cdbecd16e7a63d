--[[ prefetch: hand out the next `count` row indexes of the batch to a rollout rank (MindSpeed's
prefetch_request_index): many ranks calling at once never get the same row.

Under a staleness bound it is also admission control, as AReaL's rollout controller does: rows are
admitted in training batches of B rows, and the batch a row falls in (rows admitted before it / B) will
be trained at that version at the earliest; if it is more than max_staleness versions ahead of the
current one, the row would be stale before it could train, so nothing is handed out until the trainer
catches up. Discarded groups give their rows back to this count (discard.lua).

KEYS[1]     td:{NAME}:meta
KEYS[2]     td:{NAME}:cursor    the next row to hand out (reset by a whole clear)
KEYS[3]     td:{NAME}:admitted  rows admitted so far (kept by clears: versions are)
KEYS[4]     td:{NAME}:version
ARGV[1]     the schema the client expects (see include/schema.lua)
ARGV[2]     count
ARGV[3]     capacity (rows in the dock)
ARGV[4]     B, rows per training batch (gbs_train x n); 0: no admission control
ARGV[5]     max_staleness

Returns {} when the cursor has passed the last row, {-1} when admission refuses, else {first, stop}:
rows [first, stop), which is shorter than count at the end of the dock. The cursor moves by count
whenever rows are handed out, as MindSpeed's does.

last        how long to keep the reply, in ms; and td:{NAME}:reply:REQUEST_ID as the last key
            (include/once.lua): a resend after a lost reply gets the same rows, and the cursor moves once
]]
-- @include bits
-- @include schema
-- @include current_version
-- @include once

local reply_key, reply_ttl = once_args()
local kept = kept_reply(reply_key)
if kept then return kept end

local wrong_schema = schema_error(KEYS[1], ARGV[1])
if wrong_schema then return redis.error_reply(wrong_schema) end
local bad = wrong_type(2, 4, 'string')
if bad then return redis.error_reply(bad) end
local count, capacity = tonumber(ARGV[2]), tonumber(ARGV[3])
local first = tonumber(redis.call('GET', KEYS[2]) or '0')
if not first then return redis.error_reply('CORRUPT ' .. KEYS[2] .. ' holds no integer') end
if first >= capacity then return {} end
local stop = math.min(first + count, capacity)
local batch = tonumber(ARGV[4])
if batch > 0 then
  local admitted = tonumber(redis.call('GET', KEYS[3]) or '0')
  if not admitted then return redis.error_reply('CORRUPT ' .. KEYS[3] .. ' holds no integer') end
  local version, lost = current_version(KEYS[1], KEYS[4])
  if not version then return redis.error_reply(lost) end
  if math.floor((admitted + stop - first - 1) / batch) > version + tonumber(ARGV[5]) then return {-1} end
  redis.call('INCRBY', KEYS[3], stop - first)
end
redis.call('INCRBY', KEYS[2], count)
return keep_reply(reply_key, reply_ttl, {first, stop})

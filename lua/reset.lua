--[[ reset: make rows (or every row) available to one consumer again, as if it had never been handed
them (MindSpeed's clear(consumer) for a consumer other than the trainer, and the TransferQueue's
reset_consumer_status). Their leases end with it: an ack of one releases nothing.

KEYS[1]     td:{NAME}:meta
KEYS[2]     td:{NAME}:consumed:CONSUMER
KEYS[3]     td:{NAME}:gtaken:CONSUMER
KEYS[4]     td:{NAME}:leases:CONSUMER
KEYS[5]     td:{NAME}:tokens:CONSUMER
KEYS[6]     td:{NAME}:gremnant:CONSUMER (see include/leases.lua): deleted with every row; with some rows it
            may keep marks of groups no longer given back in part, which sampling finds out (a hint)
ARGV[1]     the schema the client expects (see include/schema.lua)
ARGV[2]     n_samples_per_prompt
ARGV[3..]   rows, decimal; none resets every row

Returns the number of rows that had been handed to the consumer and now are not.

last        how long to keep the reply, in ms; and td:{NAME}:reply:REQUEST_ID as the last key
            (include/once.lua): a resend after a lost reply gives back no rows handed out since
]]
-- @include bits
-- @include schema
-- @include leases
-- @include once

local reply_key, reply_ttl = once_args()
local kept = kept_reply(reply_key)
if kept then return kept end

local wrong_schema = schema_error(KEYS[1], ARGV[1])
if wrong_schema then return redis.error_reply(wrong_schema) end
local bad = wrong_type(2, 3, 'string') or wrong_type(4, 4, 'zset') or wrong_type(5, 5, 'hash')
  or wrong_type(6, 6, 'string')
if bad then return redis.error_reply(bad) end
local before = redis.call('BITCOUNT', KEYS[2])
if #ARGV == 2 then
  redis.call('DEL', KEYS[2], KEYS[3], KEYS[4], KEYS[5], KEYS[6])
  return keep_reply(reply_key, reply_ttl, before)
end
local rows, fields = numbers_from(3), {}
for i = 1, #rows do fields[i] = ARGV[i + 2] end
drop_leases(KEYS[4], KEYS[5], fields)
give_back(KEYS[2], KEYS[3], rows, tonumber(ARGV[2]))
return keep_reply(reply_key, reply_ttl, before - redis.call('BITCOUNT', KEYS[2]))

--[[ ack: confirm that a consumer has finished with rows it leased.

The rows leave the lease set and stay marked consumed. Only rows still leased under the token the
ack names are released (see include/leases.lua): an ack arriving after the lease expired and the rows
went to another worker, or from before a clear that made way for new rows, changes nothing. Repeating
an ack is harmless.

KEYS[1]     td:{NAME}:meta
KEYS[2]     td:{NAME}:leases:CONSUMER
KEYS[3]     td:{NAME}:tokens:CONSUMER
ARGV[1]     the schema the client expects (see include/schema.lua)
ARGV[2]     the lease token get_experience returned with the rows
ARGV[3..]   row indexes, decimal

Returns how many of the rows were released (still leased under that token).

last        how long to keep the reply, in ms; and td:{NAME}:reply:REQUEST_ID as the last key
            (include/once.lua): a resend after a lost reply says how many the ack released
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
local bad = wrong_type(2, 2, 'zset') or wrong_type(3, 3, 'hash')
if bad then return redis.error_reply(bad) end

local rows = {}
for i = 3, #ARGV do rows[#rows + 1] = ARGV[i] end
local holders = holders_of(KEYS[3], rows)
local mine = {}
for i = 1, #rows do
  if holders[i] == ARGV[2] then mine[#mine + 1] = rows[i] end
end
end_leases(KEYS[2], KEYS[3], mine)
return keep_reply(reply_key, reply_ttl, #mine)

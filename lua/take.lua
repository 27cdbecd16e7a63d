--[[ take: hand explicitly chosen rows to a consumer once they are written in every column.

Checks and marks in one step, so a call that finds rows missing marks nothing and can be retried.
First it gives back the consumer's rows whose lease expired unacked, as sampling does.

Repeating a call is harmless (the same rows are marked again; a lease gets the new deadline), so
a client may retry it after a dropped connection. Taking a row leased by an earlier call moves the
lease to this call (with a lease) or ends it (without one: the row is now handed out for good), so
the earlier call's ack no longer releases it.

KEYS[1]     td:{NAME}:meta
KEYS[2]     td:{NAME}:consumed:CONSUMER
KEYS[3]     td:{NAME}:gtaken:CONSUMER
KEYS[4]     td:{NAME}:leases:CONSUMER
KEYS[5]     td:{NAME}:tokens:CONSUMER
KEYS[6]     td:{NAME}:redelivered:CONSUMER
KEYS[7]     td:{NAME}:epoch
KEYS[8]     td:{NAME}:gen
KEYS[9..]   td:{NAME}:ready:COLUMN for each requested column
ARGV[1]     the schema the client expects (see include/schema.lua)
ARGV[2]     n_samples_per_prompt
ARGV[3]     lease in ms; 0 hands rows out for good
ARGV[4]     token of the lease (unused without one)
ARGV[5..]   the rows as runs: start, length, ... (ascending, disjoint)

Returns {1, epoch, generations, "row,row,..."} when the rows were all written (they are now marked
consumed; see sample.lua for the generations; the list names the rows this call handed out that were
not handed out before, which a call that cannot deliver gives back), else {0, column position (1 = KEYS[9]), row, column position,
row, ...} naming every missing cell.

last        how long to keep the reply, in ms; and td:{NAME}:reply:REQUEST_ID as the last key
            (include/once.lua): a resend after a lost reply gets the same reply
]]
-- @include bits
-- @include schema
-- @include leases
-- @include generations
-- @include once

local reply_key, reply_ttl = once_args()
local kept = kept_reply(reply_key)
if kept then return kept end

local wrong_schema = schema_error(KEYS[1], ARGV[1])
if wrong_schema then return redis.error_reply(wrong_schema) end
local bad = wrong_type(2, 3, 'string') or wrong_type(4, 4, 'zset') or wrong_type(5, 5, 'hash')
  or wrong_type(6, #KEYS, 'string')
if bad then return redis.error_reply(bad) end

local n, lease_ms = tonumber(ARGV[2]), tonumber(ARGV[3])
local now = now_ms()
local _, corrupt = reclaim_expired(KEYS[2], KEYS[3], KEYS[4], KEYS[5], KEYS[6], n, now)
if corrupt then return redis.error_reply(corrupt) end

local starts, lengths = runs_from(5)
local rows = rows_of_runs(starts, lengths)
local missing = {0}
for k = 9, #KEYS do
  local bits = get_bits(KEYS[k], rows)
  for i = 1, #rows do
    if bits[i] == 0 then
      missing[#missing + 1] = k - 8; missing[#missing + 1] = rows[i]
    end
  end
end
if #missing > 1 then return missing end
local before, fresh = get_bits(KEYS[2], rows), {}
for i = 1, #rows do
  if before[i] == 0 then fresh[#fresh + 1] = rows[i] end
end
mark_runs_taken(KEYS[2], KEYS[3], starts, lengths, n)
if lease_ms > 0 then
  lease_rows(KEYS[4], KEYS[5], rows, now + lease_ms, ARGV[4])
else
  drop_leases(KEYS[4], KEYS[5], rows)
end
return keep_reply(reply_key, reply_ttl,
  {1, epoch_of(KEYS[7]), generations_of_runs(KEYS[8], starts, lengths), table.concat(fresh, ',')})

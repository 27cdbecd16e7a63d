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
KEYS[9]     td:{NAME}:named:LABEL, the record of a named take (unused when ARGV[6] is 0)
KEYS[10]    td:{NAME}:named, the index of the records: member = a record's key, score = when it expires
            (ms of server time); what finds every record of the dock without SCAN (a checkpoint)
KEYS[11]    td:{NAME}:gremnant:CONSUMER (see include/leases.lua)
KEYS[12..]  td:{NAME}:ready:COLUMN for each requested column
ARGV[1]     the schema the client expects (see include/schema.lua)
ARGV[2]     n_samples_per_prompt
ARGV[3]     lease in ms; 0 hands rows out for good
ARGV[4]     token of the lease (unused without one)
ARGV[5]     1: exclusive, 0: not (see below)
ARGV[6]     ms to keep the record of a named take; 0: the take is not named
ARGV[7]     a named take's rows in the caller's order, "row,row,..." (what later takes get back)
ARGV[8..]   the rows as runs: start, length, ... (ascending, disjoint)

Returns {1, epoch, generations, "row,row,..."} when the rows were all written (they are now marked
consumed; see sample.lua for the generations; the list names the rows this call handed out that were
not handed out before, which a call that cannot deliver gives back), else {0, column position (1 = KEYS[12]), row, column position,
row, ...} naming every missing cell.

An exclusive take hands out only rows nobody has been handed: if one of them was handed to the consumer
already (and not given back), it marks nothing and returns {2, "row,row,..."} naming those rows. Callers
that choose rows from what they read of the bitmaps (the TransferQueue adapter's samplers) use it as a
compare-and-set: two callers that chose the same row cannot both get it; the loser reads and chooses again.

A named take (ARGV[6] > 0) records the runs it handed out under KEYS[9]; a later take under the same name
hands nothing out and returns {3, epoch, generations, "row,row,..."}: the recorded rows, in the order the
first caller gave them (generations in run order, as always). The ranks of
one data-parallel group that must read the same rows (TransferQueue's RankAwareSampler) name their take
after (task, rank, batch): whichever comes first chooses and takes, in the same step as the record, so a
rank dying between the two cannot leave the others to choose other rows.

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
  or wrong_type(6, 9, 'string') or wrong_type(10, 10, 'zset') or wrong_type(11, #KEYS, 'string')
if bad then return redis.error_reply(bad) end

local n, lease_ms = tonumber(ARGV[2]), tonumber(ARGV[3])
local now = now_ms()
local _, corrupt = reclaim_expired(KEYS[2], KEYS[3], KEYS[11], KEYS[4], KEYS[5], KEYS[6], n, now)
if corrupt then return redis.error_reply(corrupt) end

local exclusive, record_ms = ARGV[5] == '1', tonumber(ARGV[6])
if record_ms > 0 then
  -- The record is "start,length,...|row,row,...": the runs (for the generations) and the caller's order.
  local recorded = redis.call('GET', KEYS[9])
  if recorded then
    local runs, order = string.match(recorded, '^([%d,]*)|([%d,]*)$')
    if not runs then return redis.error_reply('ERR ' .. KEYS[9] .. ' is not a record of a named take') end
    local rec_starts, rec_lengths = {}, {}
    for start, length in string.gmatch(runs, '(%d+),(%d+)') do
      rec_starts[#rec_starts + 1] = tonumber(start); rec_lengths[#rec_lengths + 1] = tonumber(length)
    end
    return keep_reply(reply_key, reply_ttl,
      {3, epoch_of(KEYS[7]), generations_of_runs(KEYS[8], rec_starts, rec_lengths), order})
  end
end

local starts, lengths = runs_from(8)
local rows = rows_of_runs(starts, lengths)
local missing = {0}
for k = 12, #KEYS do
  local bits = get_bits(KEYS[k], rows)
  for i = 1, #rows do
    if bits[i] == 0 then
      missing[#missing + 1] = k - 11; missing[#missing + 1] = rows[i]
    end
  end
end
if #missing > 1 then return missing end
local before, fresh, taken = get_bits(KEYS[2], rows), {}, {}
for i = 1, #rows do
  if before[i] == 0 then fresh[#fresh + 1] = rows[i] else taken[#taken + 1] = rows[i] end
end
if exclusive and #taken > 0 then return {2, table.concat(taken, ',')} end
mark_runs_taken(KEYS[2], KEYS[3], starts, lengths, n)
if record_ms > 0 then
  local runs = {}
  for i = 1, #starts do runs[#runs + 1] = starts[i] .. ',' .. lengths[i] end
  redis.call('SET', KEYS[9], table.concat(runs, ',') .. '|' .. ARGV[7], 'PX', record_ms)
  -- Indexed with its expiry, and the index rid of the records gone since: it stays as small as the
  -- records alive.
  redis.call('ZREMRANGEBYSCORE', KEYS[10], '-inf', now)
  redis.call('ZADD', KEYS[10], now + record_ms, KEYS[9])
end
if lease_ms > 0 then
  lease_rows(KEYS[4], KEYS[5], rows, now + lease_ms, ARGV[4])
else
  drop_leases(KEYS[4], KEYS[5], rows)
end
return keep_reply(reply_key, reply_ttl,
  {1, epoch_of(KEYS[7]), generations_of_runs(KEYS[8], starts, lengths), table.concat(fresh, ',')})

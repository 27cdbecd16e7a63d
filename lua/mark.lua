--[[ mark: the second step of a put on a sharded dock: mark rows ready whose bytes were just written,
and record what a rollout put says of them (include/finish.lua).

On a sharded dock (Redis Cluster, see broker/data/sharded_store.py) the rows' bytes live on other slots than this
script's keys, so a put cannot be one MULTI: the client reads the rows' epoch and generations (the
read fence, include/generations.lua; claim.lua for a put naming a delivery), writes the bytes into the
data hashes of that epoch under fields "ROW:GENERATION", and then runs this script. A clear landing
between the two steps bumped the epoch or the rows' generations and deleted (or will delete) the bytes
of the old ones; marking the rows then would leave them ready with no bytes. So this script marks
nothing unless the epoch and every row's generation are still the ones the bytes were written under,
and otherwise returns the rows whose generation moved: the client removes their bytes and puts again
under the new ones, or, for a put naming a delivery, refuses (the rows are no longer that delivery's).
A put naming a leased delivery is also refused (FENCED) if the lease is no longer its own.

KEYS[1]       td:{NAME}:meta
KEYS[2]       td:{NAME}:epoch
KEYS[3]       td:{NAME}:gen
KEYS[4]       td:{NAME}:tokens:CONSUMER    of the delivery's lease (td:{NAME}:meta without one)
KEYS[5]       td:{NAME}:leases:CONSUMER    (td:{NAME}:meta without a lease)
KEYS[2i+4]    td:{NAME}:ready:COLUMN_i     row bitmap of the i-th column written
KEYS[2i+5]    td:{NAME}:gready:COLUMN_i    group bitmap of the i-th column written
then, for each of the L length columns written:
              td:{NAME}:len:COLUMN         u32 per row (see include/bits.lua set_u32)
then, if ARGV[10] is not "-":  the keys of include/finish.lua
last          td:{NAME}:reply:REQUEST_ID   the put's request id (include/once.lua)
ARGV[1]       the schema the client expects (see include/schema.lua)
ARGV[2]       n_samples_per_prompt
ARGV[3]       pub/sub channel to announce the put on (td:{NAME}:events)
ARGV[4]       the command announcing it: PUBLISH, or SPUBLISH on a Redis 7 cluster
ARGV[5]       L, the number of length columns written
ARGV[6]       the epoch the bytes were written under
ARGV[7]       the rows' generations they were written under, 4 bytes per row in run order
ARGV[8]       the token of the delivery's lease the put names, or ""
ARGV[9]       "1": the put also acks its rows (as put.lua's ARGV[8]), "0": it does not
ARGV[10]      what the put records beside its bytes, as put.lua's ARGV[6]
ARGV[11]      the version of the rows, or ""
ARGV[12]      R, the number of values that follow for the runs
ARGV[13..12+R] rows written, as runs: start, length, ... (ascending, disjoint)
then, per length column, one value per row written, in the order of the runs; then the flags
last          how long to keep the reply, in ms (include/once.lua)

Returns {rows written, rows newly finished} when marked; {-1, epoch now, "row,row,..."} when the epoch
moved (every row is stale) or some rows' generations did (those rows), having marked nothing.
]]
-- @include bits
-- @include schema
-- @include generations
-- @include delivery
-- @include mark_ready
-- @include finish
-- @include leases
-- @include once

local reply_key, reply_ttl = once_args()
local kept = kept_reply(reply_key)
if kept then return kept end
local wrong_schema = schema_error(KEYS[1], ARGV[1])
if wrong_schema then return redis.error_reply(wrong_schema) end
local nlen, finishing, nruns = tonumber(ARGV[5]), ARGV[10], tonumber(ARGV[12])
local starts, lengths = {}, {}
for i = 13, 12 + nruns, 2 do
  starts[#starts + 1] = tonumber(ARGV[i]); lengths[#lengths + 1] = tonumber(ARGV[i + 1])
end
local first_len = #KEYS - nlen - (finishing ~= '-' and FINISH_KEYS or 0) + 1
local bad = wrong_type(2, 3, 'string') or wrong_type(4, 4, 'hash') or (ARGV[8] ~= '' and wrong_type(5, 5, 'zset'))
  or wrong_type(6, first_len + nlen - 1, 'string')
if finishing ~= '-' then bad = bad or finish_wrong_type(first_len + nlen) end
if bad then return redis.error_reply(bad) end

local epoch = epoch_of(KEYS[2])
if epoch ~= tonumber(ARGV[6]) then return {-1, epoch, ''} end
local unchanged = unchanged_rows(KEYS[2], KEYS[3], epoch, ARGV[7], starts, lengths)
local total = 0
for i = 1, #lengths do total = total + lengths[i] end
if #unchanged < total then
  local same, stale = {}, {}
  for i = 1, #unchanged do same[unchanged[i]] = true end
  for _, row in ipairs(rows_of_runs(starts, lengths)) do
    if not same[row] then stale[#stale + 1] = row end
  end
  return {-1, epoch, table.concat(stale, ',')}
end
if ARGV[8] ~= '' then
  local fenced = fenced_off(KEYS[2], KEYS[3], KEYS[4], epoch, ARGV[7], ARGV[8], starts, lengths)
  if fenced then return redis.error_reply(fenced) end
end

local ready_keys, gready_keys, len_keys = {}, {}, {}
for k = 6, first_len - 1, 2 do
  ready_keys[#ready_keys + 1] = KEYS[k]; gready_keys[#gready_keys + 1] = KEYS[k + 1]
end
for j = 1, nlen do len_keys[j] = KEYS[first_len + j - 1] end
local n = tonumber(ARGV[2])
local written = mark_ready(ready_keys, gready_keys, len_keys, 13 + nruns, starts, lengths, n, ARGV[4], ARGV[3])
if ARGV[9] == '1' then end_leases(KEYS[5], KEYS[4], rows_of_runs(starts, lengths)) end  -- fenced: ours
local newly = finish_put(first_len + nlen, starts, lengths, n, finishing, ARGV[11], 13 + nruns + nlen * written, written)
return keep_reply(reply_key, reply_ttl, {written, newly})

--[[ put: mark rows as written in some columns, record what a rollout put says of them, and wake
waiting readers: the last step of a put on one slot.

The client sends this right after gate.lua, bar.lua and the HSETs of the rows' bytes, inside the same
MULTI/EXEC (unbar.lua follows), so no reader can see a row ready whose bytes are not there, and a failed
transaction marks nothing. Unless gate.lua's verdict (td:{NAME}:gate) is "go", the HSETs wrote nothing
(bar.lua saw to it) and this marks nothing either: it answers with the verdict, the kept reply of the
put this one repeats, or the error. A put changes no generation (see include/generations.lua):
rewriting a row that a reader was handed replaces its bytes, it does not take the row away from that
reader.

KEYS[1]       td:{NAME}:meta
KEYS[2]       td:{NAME}:gate               gate.lua's verdict
KEYS[2i+1]    td:{NAME}:ready:COLUMN_i     row bitmap of the i-th column written
KEYS[2i+2]    td:{NAME}:gready:COLUMN_i    group bitmap of the i-th column written
then, for each of the L length columns written (after the k columns' pairs):
              td:{NAME}:len:COLUMN         u32 per row: the rows' values (see include/bits.lua set_u32)
then, if ARGV[8] is "1":  td:{NAME}:leases:CONSUMER, td:{NAME}:tokens:CONSUMER of the delivery's lease
then, if ARGV[6] is not "-":  the keys of include/finish.lua
last          td:{NAME}:reply:REQUEST_ID   the put's request id (include/once.lua)
ARGV[1]       the schema the client expects (see include/schema.lua)
ARGV[2]       n_samples_per_prompt (rows per group)
ARGV[3]       pub/sub channel to announce the put on (td:{NAME}:events)
ARGV[4]       the command announcing it: PUBLISH, or SPUBLISH on a Redis 7 cluster
ARGV[5]       L, the number of length columns written
ARGV[6]       what the put records beside its bytes (include/finish.lua): "-" nothing, "1" completion
              flags (one per row, after the length values), "0" none but the version
ARGV[7]       the version of the rows, or "" (with ARGV[6] not "-")
ARGV[8]       "1": the put also acks its rows, ending the lease of the delivery it names (gate.lua checked it
              is still that delivery's): the result written, the rows are done and never redone, as
              Kafka commits a consumer's offsets in the transaction of what it produced. "0": it does not
ARGV[9]       R, the number of values that follow for the runs
ARGV[10..9+R] rows written, as runs: start, length, start, length, ... (ascending, disjoint)
then, per length column, one value per row written, in the order of the runs; then the flags
last          how long to keep the reply, in ms (include/once.lua)

Lengths are stored here, beside the ready bits and in the same transaction as the bytes, so that the
sampling script can weigh rows by them without reading or decoding any row.

Publishes and returns {rows written, rows newly finished}.
]]
-- @include bits
-- @include mark_ready
-- @include finish
-- @include leases
-- @include once

local reply_key, reply_ttl = once_args()
local nlen, finishing, acking, nruns = tonumber(ARGV[5]), ARGV[6], ARGV[8] == '1', tonumber(ARGV[9])
local first_finish = #KEYS - (finishing ~= '-' and FINISH_KEYS or 0) + 1
local first_len = first_finish - (acking and 2 or 0) - nlen
local starts, lengths = {}, {}
for i = 10, 9 + nruns, 2 do
  starts[#starts + 1] = tonumber(ARGV[i]); lengths[#lengths + 1] = tonumber(ARGV[i + 1])
end

local verdict = redis.call('GET', KEYS[2])
if verdict ~= 'go' then
  if verdict == '=replay' then return kept_reply(reply_key) end
  return redis.error_reply(verdict or 'NOGATE the put\'s first step (gate.lua) did not run; nothing was written')
end
-- gate.lua checked the schema and the data hashes in this MULTI; what it did not check, here.
local bad = wrong_type(2, first_len + nlen - 1, 'string')
if acking then bad = bad or wrong_type(first_finish - 2, first_finish - 2, 'zset')
  or wrong_type(first_finish - 1, first_finish - 1, 'hash') end
if finishing ~= '-' then bad = bad or finish_wrong_type(first_finish) end
if bad then return redis.error_reply(bad) end

local ready_keys, gready_keys, len_keys = {}, {}, {}
for k = 3, first_len - 1, 2 do
  ready_keys[#ready_keys + 1] = KEYS[k]; gready_keys[#gready_keys + 1] = KEYS[k + 1]
end
for j = 1, nlen do len_keys[j] = KEYS[first_len + j - 1] end
local n = tonumber(ARGV[2])
local written = mark_ready(ready_keys, gready_keys, len_keys, 10 + nruns, starts, lengths, n, ARGV[4], ARGV[3])
if acking then drop_leases(KEYS[first_finish - 2], KEYS[first_finish - 1], rows_of_runs(starts, lengths)) end
local newly = finish_put(first_finish, starts, lengths, n, finishing, ARGV[7], 10 + nruns + nlen * written, written)
return keep_reply(reply_key, reply_ttl, {written, newly})

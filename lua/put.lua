--[[ put: mark rows as written in some columns and wake waiting readers.

The client sends this right after the HSETs of the rows' bytes, inside the same MULTI/EXEC, so no
reader can see a row ready whose bytes are not there, and a failed transaction marks nothing. A put
changes no generation (see include/generations.lua): rewriting a row that a reader was handed
replaces its bytes, it does not take the row away from that reader.

KEYS[1]       td:{NAME}:meta
KEYS[3i-1]    td:{NAME}:data:COLUMN_i      data hash of the i-th column written (checked: a HSET that
                                           failed inside the MULTI left a non-hash here)
KEYS[3i]      td:{NAME}:ready:COLUMN_i     row bitmap of the i-th column written
KEYS[3i+1]    td:{NAME}:gready:COLUMN_i    group bitmap of the i-th column written
then, for each of the L length columns written (after the k columns' triples):
              td:{NAME}:len:COLUMN         u32 per row: the rows' values (see include/bits.lua set_u32)
ARGV[1]       the schema the client expects (see include/schema.lua)
ARGV[2]       n_samples_per_prompt (rows per group)
ARGV[3]       pub/sub channel to announce the put on (td:{NAME}:events)
ARGV[4]       the command announcing it: PUBLISH, or SPUBLISH on a Redis 7 cluster
ARGV[5]       L, the number of length columns written
ARGV[6]       R, the number of values that follow for the runs
ARGV[7..6+R]  rows written, as runs: start, length, start, length, ... (ascending, disjoint)
then, per length column, one value per row written, in the order of the runs

Lengths are stored here, beside the ready bits and in the same transaction as the bytes, so that the
sampling script can weigh rows by them without reading or decoding any row.

Publishes and returns the number of rows written.
]]
-- @include bits
-- @include schema
-- @include mark_ready

local nlen, nruns = tonumber(ARGV[5]), tonumber(ARGV[6])
local starts, lengths = {}, {}
for i = 7, 6 + nruns, 2 do
  starts[#starts + 1] = tonumber(ARGV[i]); lengths[#lengths + 1] = tonumber(ARGV[i + 1])
end
local last_triple = #KEYS - nlen          -- KEYS[2..last_triple] are the columns' triples

local wrong_schema = schema_error(KEYS[1], ARGV[1])
if wrong_schema then
  -- The HSETs before this script already ran: take their bytes out again, so a put on a dock that
  -- vanished leaves no keys behind. (A row it overwrote loses its old bytes too: the dock is no
  -- longer the one this client knows, and it refuses to read or mark anything in it.)
  local rows, fields = rows_of_runs(starts, lengths), {}
  for i = 1, #rows do fields[i] = tostring(rows[i]) end
  for k = 2, last_triple, 3 do
    if redis.call('TYPE', KEYS[k])['ok'] == 'hash' then call_in_chunks('HDEL', KEYS[k], fields) end
  end
  return redis.error_reply(wrong_schema)
end
for k = 2, last_triple, 3 do
  local bad = wrong_type(k, k, 'hash') or wrong_type(k + 1, k + 2, 'string')
  if bad then return redis.error_reply(bad) end
end
local bad = wrong_type(last_triple + 1, #KEYS, 'string')
if bad then return redis.error_reply(bad) end

local ready_keys, gready_keys, len_keys = {}, {}, {}
for k = 3, last_triple, 3 do
  ready_keys[#ready_keys + 1] = KEYS[k]; gready_keys[#gready_keys + 1] = KEYS[k + 1]
end
for j = 1, nlen do len_keys[j] = KEYS[last_triple + j] end
return mark_ready(ready_keys, gready_keys, len_keys, 7 + nruns, starts, lengths, tonumber(ARGV[2]), ARGV[4], ARGV[3])

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
ARGV[1]       the schema the client expects (see include/schema.lua)
ARGV[2]       n_samples_per_prompt (rows per group)
ARGV[3]       pub/sub channel to announce the put on (td:{NAME}:events)
ARGV[4..]     rows written, as runs: start, length, start, length, ... (ascending, disjoint)

Publishes and returns the number of rows written.
]]
-- @include bits
-- @include schema

local starts, lengths = runs_from(4)

local wrong_schema = schema_error(KEYS[1], ARGV[1])
if wrong_schema then
  -- The HSETs before this script already ran: take their bytes out again, so a put on a dock that
  -- vanished leaves no keys behind. (A row it overwrote loses its old bytes too: the dock is no
  -- longer the one this client knows, and it refuses to read or mark anything in it.)
  local rows, fields = rows_of_runs(starts, lengths), {}
  for i = 1, #rows do fields[i] = tostring(rows[i]) end
  for k = 2, #KEYS, 3 do
    if redis.call('TYPE', KEYS[k])['ok'] == 'hash' then call_in_chunks('HDEL', KEYS[k], fields) end
  end
  return redis.error_reply(wrong_schema)
end
for k = 2, #KEYS, 3 do
  local bad = wrong_type(k, k, 'hash') or wrong_type(k + 1, k + 2, 'string')
  if bad then return redis.error_reply(bad) end
end

local n = tonumber(ARGV[2])
local written = 0
for i = 1, #lengths do written = written + lengths[i] end
local groups = groups_of_runs(starts, lengths, n)
for k = 3, #KEYS, 3 do
  set_runs(KEYS[k], starts, lengths, 1)
  -- A put only adds rows, so it can complete groups but never break one.
  local full = group_states(KEYS[k], groups, n)
  local done = {}
  for i = 1, #groups do
    if full[i] then done[#done + 1] = groups[i] end
  end
  set_bits(KEYS[k + 1], done, 1)
end
redis.call('PUBLISH', ARGV[3], written)
return written

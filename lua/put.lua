--[[ put: mark rows as written in some columns and wake waiting readers.

The client sends this right after the HSETs of the rows' bytes, inside the same MULTI/EXEC, so no
reader can see a row ready whose bytes are not there, and a failed transaction marks nothing.

KEYS[3i-2]  td:{NAME}:data:COLUMN_i      data hash of the i-th column written (only checked: a HSET
                                         that failed inside the MULTI left a non-hash here)
KEYS[3i-1]  td:{NAME}:ready:COLUMN_i     row bitmap of the i-th column written
KEYS[3i]    td:{NAME}:gready:COLUMN_i    group bitmap of the i-th column written
ARGV[1]     n_samples_per_prompt (rows per group)
ARGV[2]     pub/sub channel to announce the put on (td:{NAME}:events)
ARGV[3..]   rows written, as runs: start, length, start, length, ... (ascending, disjoint)

Publishes and returns the number of rows written.
]]
-- @include bits

for k = 1, #KEYS, 3 do
  local bad = wrong_type(k, k, 'hash') or wrong_type(k + 1, k + 2, 'string')
  if bad then return redis.error_reply(bad) end
end

local n = tonumber(ARGV[1])
local starts, lengths = runs_from(3)
local groups = groups_of_runs(starts, lengths, n)
local rows = 0
for i = 1, #lengths do rows = rows + lengths[i] end
for k = 2, #KEYS, 3 do
  set_runs(KEYS[k], starts, lengths, 1)
  -- A put only adds rows, so it can complete groups but never break one.
  local full = group_states(KEYS[k], groups, n)
  local done = {}
  for i = 1, #groups do
    if full[i] then done[#done + 1] = groups[i] end
  end
  set_bits(KEYS[k + 1], done, 1)
end
redis.call('PUBLISH', ARGV[2], rows)
return rows

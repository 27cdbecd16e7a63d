--[[ put: a put on one slot: check that it may land, mark its rows written in some columns, record what
a rollout put says of them, and wake waiting readers.

A put on one slot is one MULTI/EXEC of plain commands around this script (broker/data/slot_store.py, ``_queue``):
1. the bar: each hash the put's HSETs write (data and tail per column) is set aside (RENAME, O(1) whatever
   its size; an error where it does not exist) and a string left in its place, on which HSET fails with
   WRONGTYPE, writing nothing;
2. this script: it decides, and where the put lands it lifts the bar (each hash back in its place, or the
   string deleted where there was none) and marks the rows at once (nothing outside the MULTI sees the
   marks before the bytes);
3. TYPE of the first data key: "string" if the bar stayed, so the HSETs' errors are the bar's;
4. the HSETs of the rows' bytes;
5. the bar undone where it stayed: GETDEL of each key (deletes the bar's string; a WRONGTYPE error,
   harmless, on a hash this script put back), then RENAME of what was set aside back into its place.
Redis has no conditional transaction (every command of a MULTI runs), and only this script can let the
bytes through: the bar and its undoing are plain commands, so when this script cannot run (NOSCRIPT, or a
function library lost in a FUNCTION FLUSH, a restart that kept no functions, a replica promoted without
them) the bytes stay out and the dock is as before. No reader sees a row ready without its bytes, and a put
that must not land writes nothing. It does not land, whole, when:
- the dock is gone or changed (NODOCK, SCHEMA), or a key it writes holds something else (CORRUPT);
- it is a resend of a put that already landed (its reply is kept, include/once.lua): rewriting the
  bytes could overwrite what another worker wrote since (a rollout's put gives unfinished rows back at
  once); it answers with the kept reply;
- it names a delivery that is no longer current (include/delivery.lua): FENCED;
- it writes a group column for part of a group whose other rows hold another value (see below): GROUP;
- it would take the dock past its byte quota (include/quota.lua): QUOTA.
A put changes no generation (see include/generations.lua): rewriting a row that a reader was handed
replaces its bytes, it does not take the row away from that reader.

KEYS[1]       td:{NAME}:meta
KEYS[2]       td:{NAME}:epoch
KEYS[3]       td:{NAME}:gen
KEYS[4]       td:{NAME}:tokens:CONSUMER    of the delivery's lease (td:{NAME}:meta without one)
KEYS[5]       td:{NAME}:leases:CONSUMER    (td:{NAME}:meta without a lease)
KEYS[6i+6]    td:{NAME}:data:COLUMN_i      data hash of the i-th column written: the bar's string now
KEYS[6i+7]    td:{NAME}:tail:COLUMN_i      the tails of its cut rows (broker/data/fit.py): the bar's string
KEYS[6i+8]    td:{NAME}:ready:COLUMN_i     row bitmap of the i-th column written
KEYS[6i+9]    td:{NAME}:gready:COLUMN_i    group bitmap of the i-th column written
KEYS[6i+10]   td:{NAME}:aside:COLUMN_i     the data hash, set aside by the bar (its type is checked)
KEYS[6i+11]   td:{NAME}:tailaside:COLUMN_i the tail hash, set aside (type checked)
then, for each of the L length columns written (after the k columns' sextuples):
              td:{NAME}:len:COLUMN         u32 per row: the rows' values (see include/bits.lua set_u32)
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
ARGV[8]       "1" if the put names a delivery (then ARGV[9..11] matter), else "0"
ARGV[9]       the delivery's epoch
ARGV[10]      the delivery's generations of the rows written, 4 bytes per row in run order
ARGV[11]      the token of the delivery's lease, or "" without one
ARGV[12]      "1": the put also acks its rows, ending the delivery's lease of them: the result written,
              the rows are done and never redone, as Kafka commits a consumer's offsets in the
              transaction of what it produced. "0": it does not
ARGV[13]      R, the number of values that follow for the runs
ARGV[14..13+R] rows written, as runs: start, length, start, length, ... (ascending, disjoint)
then, per length column, one value per row written, in the order of the runs; then the flags
then          the bytes of the values the put's HSETs write, tails included (include/quota.lua)
then          the bytes of the values the rest of the put writes: the first slice of a put in slices
              (broker/data/slices.py) is checked against the quota for the whole put, so that a put
              past the quota writes no slice; "0" otherwise
then          the rows of the rest of the put, as runs "start,length,start,length,..." ("" without a rest)
then          for each group of which the put writes some rows only, in each group column written: the
              column's position i among the columns written, the group, and the value the put writes
              for it (see below); then G, the number of such triples
last          how long to keep the reply, in ms (include/once.lua)

Lengths are stored here, beside the ready bits and in the same transaction as the bytes, so that the
sampling script can weigh rows by them without reading or decoding any row.

Publishes and returns {rows written, rows newly finished}.
]]
-- @include bits
-- @include schema
-- @include delivery
-- @include mark_ready
-- @include finish
-- @include leases
-- @include quota
-- @include once

local reply_key, reply_ttl = once_args()
local group_values = {}  -- {first key of the column's sextuple, group, value}
for _ = 1, tonumber(table.remove(ARGV)) do
  local value, g, k = table.remove(ARGV), tonumber(table.remove(ARGV)), 6 * tonumber(table.remove(ARGV)) + 6
  table.insert(group_values, 1, {k, g, value})
end
local ahead_runs = table.remove(ARGV)
local ahead_bytes = tonumber(table.remove(ARGV))
local put_bytes = tonumber(table.remove(ARGV))
local nlen, finishing, nruns = tonumber(ARGV[5]), ARGV[6], tonumber(ARGV[13])
local leased, acking = ARGV[11] ~= '', ARGV[12] == '1'
local first_finish = #KEYS - (finishing ~= '-' and FINISH_KEYS or 0) + 1
local first_len = first_finish - nlen
local starts, lengths = {}, {}
for i = 14, 13 + nruns, 2 do
  starts[#starts + 1] = tonumber(ARGV[i]); lengths[#lengths + 1] = tonumber(ARGV[i + 1])
end

local verdict = schema_error(KEYS[1], ARGV[1])
if not verdict then
  verdict = wrong_type(2, 3, 'string') or (leased and (wrong_type(4, 4, 'hash') or wrong_type(5, 5, 'zset')))
  for k = 6, first_len - 1, 6 do  -- the hashes as the bar set them aside (named by their own keys)
    verdict = verdict or wrong_type(k + 2, k + 3, 'string')
    for j = 0, 1 do
      local t = verdict == nil and redis.call('TYPE', KEYS[k + 4 + j])['ok'] or 'none'
      if t ~= 'none' and t ~= 'hash' then verdict = 'CORRUPT ' .. KEYS[k + j] .. ' holds a ' .. t .. ', expected a hash' end
    end
  end
  verdict = verdict or wrong_type(first_len, first_finish - 1, 'string')
  if finishing ~= '-' then verdict = verdict or finish_wrong_type(first_finish) end
end
if verdict then return redis.error_reply(verdict) end
local kept = kept_reply(reply_key)
if kept then return kept end
if ARGV[8] == '1' then
  local fenced = fenced_off(KEYS[2], KEYS[3], KEYS[4], tonumber(ARGV[9]), ARGV[10], ARGV[11], starts, lengths)
  if fenced then return redis.error_reply(fenced) end
end

-- A group column (broker/data/groups.py) holds one value per group, which every row of the group reads. A put
-- of some rows of a group (a group filled row by row; a late put from a delivery of part of a group, whose
-- other rows hold the next prompt now or are leased to another worker; a dropped row written anew beside its
-- group-mates) must not change what the group's other rows read: where any of them is ready in the column,
-- the put's value for the group (given here too, group_values) must equal the one stored, else GROUP.
local mine = {}  -- the put's rows, as a set (for the group check only)
if #group_values > 0 then
  for _, r in ipairs(rows_of_runs(starts, lengths)) do mine[r] = true end
end
for _, given in ipairs(group_values) do
  local k, g, value = given[1], given[2], given[3]
  local others, n = {}, tonumber(ARGV[2])
  for r = g * n, (g + 1) * n - 1 do
    if not mine[r] then others[#others + 1] = r end
  end
  local ready, held = get_bits(KEYS[k + 2], others), {}
  for i = 1, #others do
    if ready[i] == 1 then held[#held + 1] = others[i] end
  end
  if #held > 0 and redis.call('HGET', KEYS[k + 4], 'g' .. int_text(g)) ~= value then
    return redis.error_reply("GROUP column '" .. string.match(KEYS[k], ':data:([^:]+)$') .. "' is a group column, "
      .. 'and rows ' .. listed(held) .. ' of group ' .. int_text(g) .. ' hold another value: a put of part of the '
      .. 'group cannot change what they read (put the whole group, or clear those rows first); nothing was written')
  end
end

-- The quota (include/quota.lua): what the put adds, less what the fields it rewrites hold now. The first
-- slice of a put in slices counts the rest of the put too (its rows, ahead_runs; its bytes, ahead_bytes)
-- and adds only its own: a later slice checks its own bytes again, and is refused only if other puts
-- filled the dock meanwhile (its error then names the rows that landed, broker/data/slot_store.py).
local quota = quota_of(KEYS[1])
if quota then
  local n = tonumber(ARGV[2])
  local function fields_of(run_starts, run_lengths)
    local row_fields, group_fields, seen = {}, {}, {}
    for i = 1, #run_starts do
      for r = run_starts[i], run_starts[i] + run_lengths[i] - 1 do
        row_fields[#row_fields + 1] = tostring(r)
        local g = math.floor(r / n)
        if not seen[g] then seen[g] = true; group_fields[#group_fields + 1] = 'g' .. int_text(g) end
      end
    end
    return row_fields, group_fields
  end
  local named = group_column_names(KEYS[1])
  -- What the fields of the runs hold, where the bar set the hashes aside; and the tails they rewrite.
  local function held(run_starts, run_lengths)
    local row_fields, group_fields = fields_of(run_starts, run_lengths)
    local old, stale, rows = 0, {}, #row_fields
    for k = 6, first_len - 1, 6 do
      local column = string.match(KEYS[k], ':data:([^:]+)$')
      local fields = named[column] and group_fields or row_fields
      local tails = stored_in(KEYS[k + 5], fields)
      old = old + stored_in(KEYS[k + 4], fields) + tails
      if tails > 0 then stale[#stale + 1] = {KEYS[k + 5], fields} end
    end
    return old, stale, rows
  end
  local old, stale, rows = held(starts, lengths)
  local whole_old, whole_bytes = old, put_bytes
  if ahead_runs ~= '' then
    local ahead_starts, ahead_lengths, at = {}, {}, 0
    for v in string.gmatch(ahead_runs, '%d+') do
      at = at + 1
      if at % 2 == 1 then ahead_starts[#ahead_starts + 1] = tonumber(v) else ahead_lengths[#ahead_lengths + 1] = tonumber(v) end
    end
    local ahead_old, _, ahead_rows = held(ahead_starts, ahead_lengths)
    whole_old, whole_bytes, rows = old + ahead_old, put_bytes + ahead_bytes, rows + ahead_rows
  end
  local stored = tonumber(redis.call('HGET', KEYS[1], 'stored_bytes') or '0')
  if stored - whole_old + whole_bytes > quota then
    return redis.error_reply('QUOTA a put of ' .. int_text(rows) .. ' rows, ' .. int_text(whole_bytes)
      .. ' bytes (rewriting fields that hold ' .. int_text(whole_old) .. ') would take the dock from '
      .. int_text(stored) .. ' to ' .. int_text(stored - whole_old + whole_bytes) .. ' stored bytes, past its quota of '
      .. int_text(quota) .. ' bytes; nothing was written')
  end
  -- A rewritten row's old tail: gone, as the put's own HSETs of tails (if it cuts its rows) follow.
  for _, t in ipairs(stale) do call_in_chunks('HDEL', t[1], t[2]) end
  count_stored(KEYS[1], put_bytes - old)
end
-- The put lands: lift the bar, each hash back in its place (or the bar's string gone where there was none).
for k = 6, first_len - 1, 6 do
  for j = 0, 1 do
    if redis.call('EXISTS', KEYS[k + 4 + j]) == 1 then
      redis.call('RENAME', KEYS[k + 4 + j], KEYS[k + j])
    else
      redis.call('DEL', KEYS[k + j])
    end
  end
end

local ready_keys, gready_keys, len_keys = {}, {}, {}
for k = 6, first_len - 1, 6 do
  ready_keys[#ready_keys + 1] = KEYS[k + 2]; gready_keys[#gready_keys + 1] = KEYS[k + 3]
end
for j = 1, nlen do len_keys[j] = KEYS[first_len + j - 1] end
local n = tonumber(ARGV[2])
local written = mark_ready(ready_keys, gready_keys, len_keys, 14 + nruns, starts, lengths, n, ARGV[4], ARGV[3])
if acking and leased then end_leases(KEYS[5], KEYS[4], rows_of_runs(starts, lengths)) end  -- fenced: ours
local newly = finish_put(first_finish, starts, lengths, n, finishing, ARGV[7], 14 + nruns + nlen * written, written)
return keep_reply(reply_key, reply_ttl, {written, newly})

--[[ put: a put on one slot: check that it may land, mark its rows written in some columns, record what
a rollout put says of them, and wake waiting readers.

A put on one slot is one MULTI/EXEC: this script, bar.lua, the HSETs of the rows' bytes, then unbar.lua.
This one decides first and marks at once (nothing outside the MULTI sees the marks before the bytes),
and leaves "go" in td:{NAME}:gate when the put lands; bar.lua makes the HSETs fail unless it reads "go"
(also when this script could not run: NOSCRIPT after a restart or failover emptied the script cache), and
unbar.lua undoes that. So no reader sees a row ready without its bytes, and a put that must not land
writes nothing. It does not land, whole, when:
- the dock is gone or changed (NODOCK, SCHEMA), or a key it writes holds something else (CORRUPT);
- it is a resend of a put that already landed (its reply is kept, include/once.lua): rewriting the
  bytes could overwrite what another worker wrote since (a rollout's put gives unfinished rows back at
  once); it answers with the kept reply;
- it names a delivery that is no longer current (include/delivery.lua): FENCED;
- it would take the dock past its byte quota (include/quota.lua): QUOTA.
A put changes no generation (see include/generations.lua): rewriting a row that a reader was handed
replaces its bytes, it does not take the row away from that reader.

KEYS[1]       td:{NAME}:meta
KEYS[2]       td:{NAME}:gate               "go" for bar.lua when the put lands
KEYS[3]       td:{NAME}:epoch
KEYS[4]       td:{NAME}:gen
KEYS[5]       td:{NAME}:tokens:CONSUMER    of the delivery's lease (td:{NAME}:meta without one)
KEYS[6]       td:{NAME}:leases:CONSUMER    (td:{NAME}:meta without a lease)
KEYS[4i+3]    td:{NAME}:data:COLUMN_i      data hash of the i-th column written (its type is checked)
KEYS[4i+4]    td:{NAME}:tail:COLUMN_i      the tails of its cut rows (broker/data/fit.py; type checked)
KEYS[4i+5]    td:{NAME}:ready:COLUMN_i     row bitmap of the i-th column written
KEYS[4i+6]    td:{NAME}:gready:COLUMN_i    group bitmap of the i-th column written
then, for each of the L length columns written (after the k columns' quadruples):
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
  verdict = wrong_type(2, 4, 'string') or (leased and (wrong_type(5, 5, 'hash') or wrong_type(6, 6, 'zset')))
  for k = 7, first_len - 1, 4 do
    verdict = verdict or wrong_type(k, k + 1, 'hash') or wrong_type(k + 2, k + 3, 'string')
  end
  verdict = verdict or wrong_type(first_len, first_finish - 1, 'string')
  if finishing ~= '-' then verdict = verdict or finish_wrong_type(first_finish) end
end
if verdict then return redis.error_reply(verdict) end
local kept = kept_reply(reply_key)
if kept then return kept end
if ARGV[8] == '1' then
  local fenced = fenced_off(KEYS[3], KEYS[4], KEYS[5], tonumber(ARGV[9]), ARGV[10], ARGV[11], starts, lengths)
  if fenced then return redis.error_reply(fenced) end
end

-- The quota (include/quota.lua): what the put adds, less what the fields it rewrites hold now.
local quota = quota_of(KEYS[1])
if quota then
  local n = tonumber(ARGV[2])
  local row_fields, group_fields, seen = {}, {}, {}
  for i = 1, #starts do
    for r = starts[i], starts[i] + lengths[i] - 1 do
      row_fields[#row_fields + 1] = tostring(r)
      local g = math.floor(r / n)
      if not seen[g] then seen[g] = true; group_fields[#group_fields + 1] = 'g' .. int_text(g) end
    end
  end
  local named = group_column_names(KEYS[1])
  local old, stale = 0, {}
  for k = 7, first_len - 1, 4 do
    local column = string.match(KEYS[k], ':data:([^:]+)$')
    local fields = named[column] and group_fields or row_fields
    local tails = stored_in(KEYS[k + 1], fields)
    old = old + stored_in(KEYS[k], fields) + tails
    if tails > 0 then stale[#stale + 1] = {KEYS[k + 1], fields} end
  end
  local stored = tonumber(redis.call('HGET', KEYS[1], 'stored_bytes') or '0')
  if stored - old + put_bytes > quota then
    return redis.error_reply('QUOTA a put of ' .. int_text(put_bytes)
      .. ' bytes (rewriting fields that hold ' .. int_text(old) .. ') would take the dock from ' .. int_text(stored)
      .. ' to ' .. int_text(stored - old + put_bytes) .. ' stored bytes, past its quota of ' .. int_text(quota)
      .. ' bytes; nothing was written')
  end
  -- A rewritten row's old tail: gone, as the put's own HSETs of tails (if it cuts its rows) follow.
  for _, t in ipairs(stale) do call_in_chunks('HDEL', t[1], t[2]) end
  count_stored(KEYS[1], put_bytes - old)
end
redis.call('SET', KEYS[2], 'go')

local ready_keys, gready_keys, len_keys = {}, {}, {}
for k = 7, first_len - 1, 4 do
  ready_keys[#ready_keys + 1] = KEYS[k + 2]; gready_keys[#gready_keys + 1] = KEYS[k + 3]
end
for j = 1, nlen do len_keys[j] = KEYS[first_len + j - 1] end
local n = tonumber(ARGV[2])
local written = mark_ready(ready_keys, gready_keys, len_keys, 14 + nruns, starts, lengths, n, ARGV[4], ARGV[3])
if acking and leased then end_leases(KEYS[6], KEYS[5], rows_of_runs(starts, lengths)) end  -- fenced: ours
local newly = finish_put(first_finish, starts, lengths, n, finishing, ARGV[7], 14 + nruns + nlen * written, written)
return keep_reply(reply_key, reply_ttl, {written, newly})

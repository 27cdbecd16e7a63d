--[[ discard: take whole groups out of play, counted: groups a consumer rejects (DAPO's dynamic
sampling drops groups whose n rewards are all equal), and groups found stale under the staleness bound.

"drop" forgets the groups' rows (include/forget.lua): they are free for new prompts at once.
"regenerate" forgets everything but the prompt columns and keeps the groups' age: the rollout consumer
is offered them again, oldest first. Under partial rollout it also writes the placeholder responses a
prompt put writes, for the rollout to read, but does not mark them ready: nothing but the rollout may
take a placeholder for a response (without partial rollout no finished-groups bitmap would stop it).

Under the staleness bound (ARGV[9] given) only groups still older than it are discarded: sampling
finds stale groups and leaves them out atomically (see sample.lua), and the client that found them
discards them next. Two clients may find the same group; the version check here (the group leaves
td:{NAME}:gversions when it is discarded) makes the second one skip it, so each is counted once, and a
group regenerated meanwhile with a fresh version is left alone.

KEYS        the dock's keys in the layout of include/forget.lua, then td:{NAME}:admitted and
            td:{NAME}:version
ARGV[1]     the schema the client expects (see include/schema.lua)
ARGV[2..6]  k, m, n_samples_per_prompt, L, A (see include/forget.lua)
ARGV[7]     "drop" or "regenerate"
ARGV[8]     the field of td:{NAME}:discarded to count the groups under (a consumer, "stale", ...)
ARGV[9]     "" to discard the groups whatever their version, else max_staleness: only groups older
            than the current version minus it are discarded
ARGV[10]    0, or the position (1..m) of the consumer whose delivery the drop names: the drop is
            refused (FENCED) unless that delivery still holds every row of the groups
            (include/delivery.lua), as a filter worker's whose lease ran out must be
ARGV[11]    the delivery's epoch (with ARGV[10] > 0)
ARGV[12]    the delivery's generations of the groups' rows, 4 bytes per row, ascending
ARGV[13]    the token of the delivery's lease, or ""
ARGV[14]    P, then P column positions (1..k) kept by "regenerate"
then        Q, then Q pairs: the column position of a response column, its placeholder bytes
then        the groups, decimal
last        how long to keep the reply, in ms; and td:{NAME}:reply:REQUEST_ID as the last key
            (include/once.lua): a resend after a lost reply is not counted twice

Returns the number of groups discarded; on a sharded dock, that with what the client must delete from
the data shards (see include/forget.lua forgotten_reply). A sharded dock has no "regenerate": its kept
prompt bytes would sit under the old generation.
]]
-- @include bits
-- @include schema
-- @include forget
-- @include quota
-- @include delivery
-- @include current_version
-- @include once

local reply_key, reply_ttl = once_args()
local kept = kept_reply(reply_key)
if kept then return kept end

local wrong_schema = schema_error(KEYS[1], ARGV[1])
if wrong_schema then return redis.error_reply(wrong_schema) end
local L = forget_layout()
local bad = forget_wrong_type(L) or wrong_type(#KEYS - 1, #KEYS, 'string')
if bad then return redis.error_reply(bad) end
local mode, field = ARGV[7], ARGV[8]
local admitted_key = KEYS[#KEYS - 1]
local fresh_from = nil
if ARGV[9] ~= '' then
  local current, lost = current_version(KEYS[1], KEYS[#KEYS])
  if not current then return redis.error_reply(lost) end
  fresh_from = current - tonumber(ARGV[9])
end

local at = 14
local keep = {}
for i = 1, tonumber(ARGV[at]) do keep[tonumber(ARGV[at + i])] = true end
at = at + tonumber(ARGV[at]) + 1
local placeholders = {}
for i = 1, tonumber(ARGV[at]) do
  placeholders[#placeholders + 1] = {tonumber(ARGV[at + 2 * i - 1]), ARGV[at + 2 * i]}
end
at = at + 2 * tonumber(ARGV[at]) + 1

local named = tonumber(ARGV[10])
if named > 0 then
  local all, seen_all = {}, {}
  for i = at, #ARGV do
    local g = tonumber(ARGV[i])
    if not seen_all[g] then seen_all[g] = true; all[#all + 1] = g end
  end
  table.sort(all)
  local starts, lengths = runs_of(rows_of_groups(all, L.n))
  local fenced = fenced_off(KEYS[2], KEYS[3], KEYS[L.tokens + named], tonumber(ARGV[11]), ARGV[12], ARGV[13],
    starts, lengths)
  if fenced then return redis.error_reply(fenced) end
end

local groups, seen = {}, {}
for i = at, #ARGV do
  local g = tonumber(ARGV[i])
  if not seen[g] then
    seen[g] = true
    if not fresh_from then
      groups[#groups + 1] = g
    else
      local version = redis.call('ZSCORE', KEYS[L.gversions], g)
      if version and tonumber(version) < fresh_from then groups[#groups + 1] = g end
    end
  end
end
table.sort(groups)
if #groups == 0 then return keep_reply(reply_key, reply_ttl, forgotten_reply(L, 0)) end
local rows = rows_of_groups(groups, L.n)

if mode == 'drop' then
  forget_rows(L, rows, {}, false)
  -- Rows admitted for generation and dropped will never train: admission may offer them again.
  local admitted = tonumber(redis.call('GET', admitted_key) or '0') or 0
  if admitted > 0 then redis.call('SET', admitted_key, math.max(0, admitted - #rows)) end
else
  forget_rows(L, rows, keep, true)
  local fields = {}
  for i = 1, #rows do fields[i] = tostring(rows[i]) end
  for _, pair in ipairs(placeholders) do
    local c, bytes = pair[1], pair[2]
    if L.quota then   -- the fields were forgotten just above: what they hold now is 0 but for a kept column
      count_stored(KEYS[1], #bytes * #fields - stored_in(KEYS[L.data + c], fields))
    end
    for first = 1, #fields, UNPACK_CHUNK do
      local args = {}
      for i = first, math.min(first + UNPACK_CHUNK - 1, #fields) do
        args[#args + 1] = fields[i]; args[#args + 1] = bytes
      end
      redis.call('HSET', KEYS[L.data + c], unpack(args))
    end
  end
end
redis.call('HINCRBY', KEYS[L.discarded], field, #groups)
return keep_reply(reply_key, reply_ttl, forgotten_reply(L, #groups))

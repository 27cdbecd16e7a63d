--[[ finish: what a rollout put records beside its bytes: which rows' responses are finished, and the
policy version that produced the rows. The client queues it right after put.lua, in the same MULTI,
so a response and its flag are written together or not at all.

With completion flags (partial rollout, MindSpeed's rollout_completed), as MindSpeed's dock does:
- finished rows stay finished until they are cleared (a late duplicate put saying "unfinished" does
  not undo them), and stay handed to the rollout consumer;
- unfinished rows are given back to the rollout consumer, to be continued by its next call;
- the put is the rollout's result for these rows: their rollout leases end (a worker that dies after
  the put loses nothing; its late ack releases nothing);
- a group whose n rows are all finished is finished (gfinished, and rfinished on its rows): only
  then do other consumers see it;
- a group starts ageing at its first rollout put (grolled, age:0 / gage:0).

With a version, each group touched keeps the lowest version of any of its rows (the staleness bound
is about the oldest part of a group).

KEYS[1]     td:{NAME}:meta
KEYS[2]     td:{NAME}:finished
KEYS[3]     td:{NAME}:gfinished
KEYS[4]     td:{NAME}:rfinished
KEYS[5]     td:{NAME}:grolled
KEYS[6]     td:{NAME}:age:0
KEYS[7]     td:{NAME}:gage:0
KEYS[8]     td:{NAME}:gversions
KEYS[9]     td:{NAME}:consumed:ROLLOUT
KEYS[10]    td:{NAME}:gtaken:ROLLOUT
KEYS[11]    td:{NAME}:leases:ROLLOUT
KEYS[12]    td:{NAME}:tokens:ROLLOUT
ARGV[1]     the schema the client expects (see include/schema.lua)
ARGV[2]     n_samples_per_prompt
ARGV[3]     "1" if completion flags follow the runs, else "0"
ARGV[4]     the version of the rows, or ""
ARGV[5]     R, the number of values that follow for the runs
ARGV[6..5+R] rows written, as runs: start, length, ... (ascending, disjoint)
then        one flag per row, "1" finished or "0", in the order of the runs

Returns the number of rows newly finished.
]]
-- @include bits
-- @include schema
-- @include leases

local wrong_schema = schema_error(KEYS[1], ARGV[1])
if wrong_schema then return redis.error_reply(wrong_schema) end
local bad = wrong_type(2, 7, 'string') or wrong_type(8, 8, 'zset') or wrong_type(9, 10, 'string')
  or wrong_type(11, 11, 'zset') or wrong_type(12, 12, 'hash')
if bad then return redis.error_reply(bad) end

local n, flagged, version, nruns = tonumber(ARGV[2]), ARGV[3] == '1', ARGV[4], tonumber(ARGV[5])
local starts, lengths = {}, {}
for i = 6, 5 + nruns, 2 do
  starts[#starts + 1] = tonumber(ARGV[i]); lengths[#lengths + 1] = tonumber(ARGV[i + 1])
end
local rows = rows_of_runs(starts, lengths)
local groups = groups_of_runs(starts, lengths, n)
local newly = 0

if flagged then
  local was = get_bits(KEYS[2], rows)
  local done, undone, fields = {}, {}, {}
  for i, r in ipairs(rows) do
    fields[i] = tostring(r)
    if ARGV[5 + nruns + i] == '1' then
      done[#done + 1] = r
      if was[i] == 0 then newly = newly + 1 end
    elseif was[i] == 0 then
      undone[#undone + 1] = r
    end
  end
  set_bits(KEYS[2], done, 1)
  drop_leases(KEYS[11], KEYS[12], fields)
  if #done > 0 then mark_taken(KEYS[9], KEYS[10], done, n) end
  if #undone > 0 then give_back(KEYS[9], KEYS[10], undone, n) end
  local full = group_states(KEYS[2], groups, n)
  local complete = {}
  for i = 1, #groups do
    if full[i] then complete[#complete + 1] = groups[i] end
  end
  set_bits(KEYS[3], complete, 1)
  set_bits(KEYS[4], rows_of_groups(complete, n), 1)
  local rolled = get_bits(KEYS[5], groups)
  local first = {}
  for i = 1, #groups do
    if rolled[i] == 0 then first[#first + 1] = groups[i] end
  end
  set_bits(KEYS[5], first, 1)
  set_bits(KEYS[7], first, 1)
  set_bits(KEYS[6], rows_of_groups(first, n), 1)
end

if version ~= '' then
  local v = tonumber(version)
  for _, g in ipairs(groups) do
    local had = redis.call('ZSCORE', KEYS[8], g)
    if not had or v < tonumber(had) then redis.call('ZADD', KEYS[8], v, g) end
  end
end
return newly

--[[ finish: what a rollout put records beside its bytes, pasted in by `-- @include finish` (put.lua on one
slot, mark.lua on a sharded dock): which rows' responses are finished, and the policy version that
produced the rows. It runs in the script that marks the rows ready, so a response and its flag are
written together or not at all.

With completion flags (partial rollout, MindSpeed's rollout_completed), as MindSpeed's dock does:
- finished rows stay finished until they are cleared (a late duplicate put saying "unfinished" does
  not undo them), and stay handed to the rollout consumer;
- unfinished rows are given back to the rollout consumer, to be continued by its next call;
- the put is the rollout's result for these rows: their rollout leases end (a worker that dies after
  the put loses nothing; its late ack releases nothing, and a late put naming the lease is refused);
- a group whose n rows are all finished is finished (gfinished, and rfinished on its rows): only
  then do other consumers see it;
- a group starts ageing at its first rollout put (grolled, age:0 / gage:0).

With a version, each group touched keeps the lowest version of any of its rows (the staleness bound
is about the oldest part of a group).

The script passes the keys of `finish_rows` in this order (FINISH_KEYS of them), from KEYS[first]:
            td:{NAME}:finished, gfinished, rfinished, grolled, age:0, gage:0, gversions, then of the
            rollout consumer: consumed:ROLLOUT, gtaken:ROLLOUT, leases:ROLLOUT, tokens:ROLLOUT
]]
-- @include bits
-- @include leases

local FINISH_KEYS = 11

-- A CORRUPT message if a key of the finish layout from KEYS[first] holds the wrong type, or nil.
local function finish_wrong_type(first)
  return wrong_type(first, first + 5, 'string') or wrong_type(first + 6, first + 6, 'zset')
    or wrong_type(first + 7, first + 8, 'string') or wrong_type(first + 9, first + 9, 'zset')
    or wrong_type(first + 10, first + 10, 'hash')
end

-- Records `flags` ("1"/"0" per row of the runs, in run order; nil for none) and `version` (decimal
-- text, or "" for none) of the rows of the runs. Returns the number of rows newly finished.
local function finish_rows(first, starts, lengths, n, flags, version)
  local K = function(i) return KEYS[first + i - 1] end
  local rows = rows_of_runs(starts, lengths)
  local groups = groups_of_runs(starts, lengths, n)
  local newly = 0
  if flags then
    local was = get_bits(K(1), rows)
    local done, undone, fields = {}, {}, {}
    for i, r in ipairs(rows) do
      fields[i] = tostring(r)
      if flags[i] == '1' then
        done[#done + 1] = r
        if was[i] == 0 then newly = newly + 1 end
      elseif was[i] == 0 then
        undone[#undone + 1] = r
      end
    end
    set_bits(K(1), done, 1)
    drop_leases(K(10), K(11), fields)
    if #done > 0 then mark_taken(K(8), K(9), done, n) end
    if #undone > 0 then give_back(K(8), K(9), undone, n) end
    local full = group_states(K(1), groups, n)
    local complete = {}
    for i = 1, #groups do
      if full[i] then complete[#complete + 1] = groups[i] end
    end
    set_bits(K(2), complete, 1)
    set_bits(K(3), rows_of_groups(complete, n), 1)
    local rolled = get_bits(K(4), groups)
    local fresh = {}
    for i = 1, #groups do
      if rolled[i] == 0 then fresh[#fresh + 1] = groups[i] end
    end
    set_bits(K(4), fresh, 1)
    set_bits(K(6), fresh, 1)
    set_bits(K(5), rows_of_groups(fresh, n), 1)
  end
  if version ~= '' then
    -- Compared as numbers (exact: versions stay below 2^53), stored as the client's own text.
    local v = tonumber(version)
    for _, g in ipairs(groups) do
      local had = redis.call('ZSCORE', K(7), g)
      if not had or v < tonumber(had) then redis.call('ZADD', K(7), version, g) end
    end
  end
  return newly
end

-- What a put's script (put.lua, mark.lua) records after marking `count` rows ready: nothing when
-- `finishing` is "-", else finish_rows with the version, and with "1" the flags read from
-- ARGV[flags_at..]. Returns the number of rows newly finished.
local function finish_put(first, starts, lengths, n, finishing, version, flags_at, count)
  if finishing == '-' then return 0 end
  local flags = nil
  if finishing == '1' then
    flags = {}
    for i = 1, count do flags[i] = ARGV[flags_at + i - 1] end
  end
  return finish_rows(first, starts, lengths, n, flags, version)
end

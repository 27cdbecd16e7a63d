--[[ forget: remove rows from a dock, pasted in by `-- @include forget` (clear.lua, discard.lua).

Both scripts take the dock's keys in one layout, which `forget_layout` reads from ARGV[2..6]:

KEYS[1]           td:{NAME}:meta
KEYS[2]           td:{NAME}:epoch                bumped by a whole clear
KEYS[3]           td:{NAME}:gen                  bumped for each row forgotten
then k keys of each kind, for every column: td:{NAME}:data:COLUMN, td:{NAME}:tail:COLUMN (the tails of
                  its cut rows, broker/data/fit.py), td:{NAME}:ready:COLUMN, td:{NAME}:gready:COLUMN
then m keys of each kind, for every consumer: td:{NAME}:consumed:CONSUMER, td:{NAME}:gtaken:CONSUMER,
                  td:{NAME}:leases:CONSUMER, td:{NAME}:tokens:CONSUMER, td:{NAME}:redelivered:CONSUMER,
                  td:{NAME}:failures:CONSUMER, td:{NAME}:dead:CONSUMER, td:{NAME}:gremnant:CONSUMER
then              td:{NAME}:len:COLUMN for each of the L length columns
then              the batch's keys: td:{NAME}:cursor, td:{NAME}:metrics, td:{NAME}:discarded
then              the generation status: td:{NAME}:finished, gfinished, rfinished, grolled, claimed, gversions,
                  then td:{NAME}:age:0 .. age:A-1, then td:{NAME}:gage:0 .. gage:A-1, then
                  td:{NAME}:wait:1 .. wait:A-1 and td:{NAME}:gwait:1 .. gwait:A-1 (none when A = 0), then
                  td:{NAME}:gbatch
ARGV[2..6]        k, m, n_samples_per_prompt, L, A

On a sharded dock (its meta has a non-empty "shards" field, see broker/data/sharded_store.py) the bytes live on other
slots, which no script may touch: the data keys above are then the dock's unused one-slot data hashes
(always empty), and forget_rows records each forgotten row with the generation its bytes were written
under; `forgotten_reply` hands them to the client, which deletes those bytes from the data shards.

Group columns (the meta's "group_columns", JSON list; absent: none) hold one field per group, "g" followed
by the group in decimal (broker/control/keys.py group_field), that all n rows of the group read. Forgetting
rows deletes a group's field once no row of the group is ready in that column any more (checked after the
forgotten rows' ready bits were cleared), so a clear of some rows of a group keeps the bytes the others
read, and a clear of all n (or of the last ready ones) deletes them. Why no row is ever ready without them:
- a put on one slot is one MULTI (put.lua marks its rows, then the HSET of the group's field: see
  broker/data/slot_store.py), and this script is atomic: a clear runs wholly before or after a put. Before:
  the put writes the field and marks its rows after the clear deleted it. After: the put's rows are
  ready, so the field stays unless the clear forgot each of them (then none is ready, nobody reads it);
- a row ready in a column holds bytes there, and nothing but a forget clears a ready bit of a group
  column (the dock's unready refuses them before calling unready.lua, broker/api/generation.py;
  regeneration keeps the prompt columns, ready bits and fields both);
- a reader handed a row whose group field was deleted by a clear was handed a row that clear forgot
  (the others are still ready): its generation moved, so the reader's fence fails (include/generations.lua).
A sharded dock stores group columns per row on its data shards (see broker/data/groups.py): nothing here.

Forgetting a row deletes its bytes, clears its ready bits and every consumer's marks and leases, zeroes
its lengths, its failed deliveries and dead letters, and bumps its generation, so a reader handed it before sees the change at its read (see
include/generations.lua). Groups touched lose their group state (complete, finished, age, version): a
group missing a row is no longer the group it was.
]]
-- @include bits
-- @include leases
-- @include generations
-- @include quota

local function forget_layout()
  local k, m, n = tonumber(ARGV[2]), tonumber(ARGV[3]), tonumber(ARGV[4])
  local nlen, nages = tonumber(ARGV[5]), tonumber(ARGV[6])
  local L = {k = k, m = m, n = n, nlen = nlen, nages = nages, quota = quota_of(KEYS[1])}
  L.data, L.tail = 3, 3 + k                                 -- KEYS[L.data + c] is column c's data hash
  L.ready, L.gready = 3 + 2 * k, 3 + 3 * k
  L.consumed, L.gtaken = 3 + 4 * k, 3 + 4 * k + m
  L.leases, L.tokens, L.redelivered = 3 + 4 * k + 2 * m, 3 + 4 * k + 3 * m, 3 + 4 * k + 4 * m
  L.failures, L.dead, L.remnant = 3 + 4 * k + 5 * m, 3 + 4 * k + 6 * m, 3 + 4 * k + 7 * m
  L.lengths = 3 + 4 * k + 8 * m                             -- KEYS[L.lengths + j]: j-th length array
  L.cursor, L.metrics, L.discarded = L.lengths + nlen + 1, L.lengths + nlen + 2, L.lengths + nlen + 3
  L.finished, L.gfinished, L.rfinished = L.discarded + 1, L.discarded + 2, L.discarded + 3
  L.grolled, L.claimed, L.gversions = L.discarded + 4, L.discarded + 5, L.discarded + 6
  L.age, L.gage = L.gversions, L.gversions + nages          -- KEYS[L.age + 1 + a]: age bitmap of age a
  L.nwait = math.max(nages - 1, 0)
  L.wait, L.gwait = L.gage + nages, L.gage + nages + L.nwait  -- KEYS[L.wait + w]: waited w clears
  L.gbatch = L.gwait + L.nwait + 1
  L.last = L.gbatch
  local shards = redis.call('HGET', KEYS[1], 'shards')
  L.sharded = shards ~= false and shards ~= '[]'
  L.group = {}                                              -- L.group[c]: column c holds one field per group
  if not L.sharded then
    local named = group_column_names(KEYS[1])   -- no ':' in a key's last part: the data keys parse too
    for c = 1, k do
      local column = string.match(KEYS[L.data + c], ':data:([^:]+)$')
      if column and named[column] then L.group[c] = true end
    end
  end
  return L
end

-- Rows forgotten on a sharded dock, and the generations (4 bytes each) their bytes were written under.
local forgotten_rows, forgotten_gens = {}, {}

-- A script's reply `value`, with on a sharded dock what the client must delete from the data shards:
-- {value, the epoch the bytes were written under, "row,row,...", their generations}.
local function forgotten_reply(L, value, epoch)
  if not L.sharded then return value end
  return {value, epoch or epoch_of(KEYS[2]), table.concat(forgotten_rows, ','), table.concat(forgotten_gens)}
end

-- A CORRUPT message for the first key of the layout holding the wrong type, or nil.
local function forget_wrong_type(L)
  return wrong_type(2, 3, 'string') or wrong_type(L.data + 1, L.tail + L.k, 'hash')
    or wrong_type(L.ready + 1, L.gtaken + L.m, 'string') or wrong_type(L.leases + 1, L.leases + L.m, 'zset')
    or wrong_type(L.tokens + 1, L.tokens + L.m, 'hash') or wrong_type(L.redelivered + 1, L.redelivered + L.m, 'string')
    or wrong_type(L.failures + 1, L.dead + L.m, 'hash') or wrong_type(L.remnant + 1, L.remnant + L.m, 'string')
    or wrong_type(L.lengths + 1, L.lengths + L.nlen, 'string')
    or wrong_type(L.discarded, L.discarded, 'hash') or wrong_type(L.finished, L.claimed, 'string')
    or wrong_type(L.gversions, L.gversions, 'zset') or wrong_type(L.gversions + 1, L.last, 'string')
end

-- HDELs the fields of `groups` (distinct) in group column c that no row of theirs is ready in any more;
-- returns how many it deleted.
local function forget_group_fields(L, c, groups)
  local _, any_ready = group_states(KEYS[L.ready + c], groups, L.n)
  local empty = {}
  for i, g in ipairs(groups) do
    if any_ready[i] ~= true then empty[#empty + 1] = 'g' .. int_text(g) end
  end
  if L.quota then count_stored(KEYS[1], -stored_in(KEYS[L.data + c], empty)) end
  return call_in_chunks('HDEL', KEYS[L.data + c], empty)
end

-- Forgets `rows` (ascending). `keep` maps column positions (1..k) whose bytes and ready bits stay;
-- with `keep_age` the groups keep their age and their place in the ageing. Returns the cells removed.
local function forget_rows(L, rows, keep, keep_age)
  local groups = groups_of(rows, L.n)
  local fields, zeros, cells = {}, {}, 0
  for i = 1, #rows do fields[i] = tostring(rows[i]); zeros[i] = 0 end
  if L.sharded then
    -- In run order (ascending, distinct) on both lists: callers may pass rows in any order.
    local starts, lengths = runs_of(rows)
    forgotten_gens[#forgotten_gens + 1] = generations_of_runs(KEYS[3], starts, lengths)
    for _, row in ipairs(rows_of_runs(starts, lengths)) do forgotten_rows[#forgotten_rows + 1] = row end
  end
  bump_generations(KEYS[3], rows)
  for c = 1, L.k do
    if not keep[c] then
      if not L.group[c] then
        if L.quota then
          count_stored(KEYS[1], -stored_in(KEYS[L.data + c], fields) - stored_in(KEYS[L.tail + c], fields))
        end
        cells = cells + call_in_chunks('HDEL', KEYS[L.data + c], fields)
        call_in_chunks('HDEL', KEYS[L.tail + c], fields)   -- a cut row's tail; not a cell of its own
      end
      set_bits(KEYS[L.ready + c], rows, 0)
      set_bits(KEYS[L.gready + c], groups, 0)   -- a group missing a row is no longer complete
      if L.group[c] then cells = cells + forget_group_fields(L, c, groups) end   -- after the ready bits
    end
  end
  for j = 1, L.nlen do
    if redis.call('EXISTS', KEYS[L.lengths + j]) == 1 then set_u32(KEYS[L.lengths + j], rows, zeros) end
  end
  for u = 1, L.m do
    drop_leases(KEYS[L.leases + u], KEYS[L.tokens + u], fields)
    give_back(KEYS[L.consumed + u], KEYS[L.gtaken + u], rows, L.n)
    call_in_chunks('HDEL', KEYS[L.failures + u], fields)
    call_in_chunks('HDEL', KEYS[L.dead + u], fields)
  end
  set_bits(KEYS[L.finished], rows, 0)
  set_bits(KEYS[L.rfinished], rows_of_groups(groups, L.n), 0)
  set_bits(KEYS[L.gfinished], groups, 0)
  call_in_chunks('ZREM', KEYS[L.gversions], groups)
  if not keep_age then
    set_bits(KEYS[L.gbatch], groups, 0)            -- a dropped group leaves room in the batch                           -- a regenerated group keeps its place, age and prompt
    set_bits(KEYS[L.claimed], groups, 0)
    set_bits(KEYS[L.grolled], groups, 0)
    for a = 1, L.nages do
      set_bits(KEYS[L.age + a], rows, 0)
      set_bits(KEYS[L.gage + a], groups, 0)
    end
    for w = 1, L.nwait do
      set_bits(KEYS[L.wait + w], rows, 0)
      set_bits(KEYS[L.gwait + w], groups, 0)
    end
  end
  return cells
end

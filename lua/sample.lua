--[[ sample: pick rows that are written in every requested column and not yet handed to this
consumer, mark them handed to it, and return them; all or nothing.

Works on whole groups (the n responses of one prompt) or on single rows. Everything is bitmap
algebra on the server, so the cost grows with the bitmap bytes (capacity / 8), not with rows.
First it gives back rows whose lease expired unacked, so they are offered again. A group given back in
part (its other rows were acked, see include/leases.lua) is offered again too, and a pick of it hands out
only its rows not handed out: the unit is still the group, and the rows come as runs as ever.

A call carries a request id (see include/once.lua): a resend of it after a lost reply gets the rows
the call was handed, instead of new rows. Only a reply that hands rows out is kept.

KEYS[1]     td:{NAME}:meta
KEYS[2]     td:{NAME}:consumed:CONSUMER      row bitmap: rows handed to the consumer
KEYS[3]     td:{NAME}:gtaken:CONSUMER        group bitmap: groups with any row handed to the consumer
KEYS[4]     td:{NAME}:leases:CONSUMER        sorted set: leased rows by deadline (ms)
KEYS[5]     td:{NAME}:tokens:CONSUMER        hash: leased row -> token of its lease
KEYS[6]     td:{NAME}:redelivered:CONSUMER   counter of rows given back after their lease expired
KEYS[7]     td:{NAME}:scratch                work space, deleted before returning
KEYS[8]     td:{NAME}:epoch                  see include/generations.lua
KEYS[9]     td:{NAME}:gen
KEYS[10]    td:{NAME}:gremnant:CONSUMER     group bitmap: groups offered again with some rows handed out
KEYS[11..]  per requested column: td:{NAME}:gready:COLUMN in group mode,
            td:{NAME}:ready:COLUMN in row mode
then        td:{NAME}:len:COLUMN for each of the L length columns the "seqlen" policy weighs by
ARGV[1]     the schema the client expects (see include/schema.lua)
ARGV[2]     mode: "groups" or "rows"
ARGV[3]     how many units (groups or rows) to pick
ARGV[4]     n_samples_per_prompt
ARGV[5]     units in the dock: prompts_num in group mode, capacity in row mode
ARGV[6]     policy: "fifo" (lowest units first), "random", or "seqlen" (MindSpeed's
            use_batch_seqlen_balance: a batch of average total length, see below)
ARGV[7]     seed of the random policy, an integer in [0, 2^31)
ARGV[8]     lease in ms; 0 hands rows out for good
ARGV[9]     token of the lease (the client's request id, 'g' or 'r' first); unused without a lease
ARGV[10]    L, the number of length columns after the status bitmaps (0 unless the policy is "seqlen")
ARGV[11]    T, the number of tier bitmaps after the length columns (0: none). With tiers the picks come
            from tier 1 first (lowest units first), then tier 2, ..., then the rest: partial rollout
            passes the age bitmaps, oldest first, so that "oldest first" is bitmap algebra over
            capacity / 8 bytes per age instead of MindSpeed's re-sort of the whole dock by age.
ARGV[12]    "1": hand out what qualifies when fewer than ARGV[3] units do (at least one); "0": all or nothing
ARGV[13]    cap: hand out nothing once the consumer holds this many rows (MindSpeed's GBS_train x n);
            0 for no cap
ARGV[14]    U, the number of columns whose readiness the handout takes back (the rollout consumer's
            response columns: being generated, they are not ready for anyone else); their
            td:{NAME}:ready:COLUMN and td:{NAME}:gready:COLUMN follow the tiers, in pairs
ARGV[15]    "" or max_staleness: groups of td:{NAME}:gversions older than the current version
            (td:{NAME}:version) minus it are left out and reported, never handed out
ARGV[16]    "" or B, the groups of an iteration (partial rollout's gbs_train, group mode only): the
            first B groups handed to any consumer but the rollout form the iteration's batch
            (td:{NAME}:gbatch), and every such consumer takes groups of the batch first and new
            groups only while it is not full. Stages running in parallel, each capped at B groups,
            then hold the same groups, even when an older group finishes after one of them filled up.
then, when T > 0: td:{NAME}:scratch2, more work space; when ARGV[15] is set: td:{NAME}:version and
            td:{NAME}:gversions; when ARGV[16] is set: td:{NAME}:gbatch and td:{NAME}:scratch3
last        td:{NAME}:reply:REQUEST_ID, and as the last ARGV how long to keep the reply, in ms (include/once.lua)

The "seqlen" policy: when the qualifying units split evenly into batches of `count`, they are dealt,
longest first (the sum of the length columns over the unit's rows), each to the batch with the least
total so far (then the fewest units, then the lowest number), and the first batch to fill is handed
out: MindSpeed's get_seqlen_balanced_partitions(equal_size=True), of which it returns partition 0.
Otherwise, as in MindSpeed, it picks at random. Lengths are read from the u32 arrays that puts keep
(td:{NAME}:len:COLUMN), so weighing never reads or decodes a row.

Returns an empty list if fewer units qualify than asked (or the cap is reached), else {epoch,
generations, tiers, stale, left, start, length, start, length, ...}: the picked rows as runs, ascending (a
batch of whole groups is a few runs, not a list of every row), with the epoch and the rows'
generations (4 bytes each, in run order) that the read of their bytes checks, the tier each row came
from ("t,t,..." in run order, 0 for none; "" without tiers), the stale groups left out ("g,g,...") and
how many units still qualified after this pick (the count it already has: a partitioned dock's get
skips a partition that has none left, instead of a script call that would find nothing there).
When stale groups were left out and nothing is handed out, the reply is {-1, "", "", stale, 0}.
]]
-- @include bits
-- @include schema
-- @include leases
-- @include generations
-- @include current_version
-- @include once

local reply_key, reply_ttl = once_args()
local kept = kept_reply(reply_key)
if kept then return kept end

local wrong_schema = schema_error(KEYS[1], ARGV[1])
if wrong_schema then return redis.error_reply(wrong_schema) end
local bad = wrong_type(2, 3, 'string') or wrong_type(4, 4, 'zset') or wrong_type(5, 5, 'hash')
  or wrong_type(6, 6, 'string')
if bad then return redis.error_reply(bad) end

local consumed, gtaken, leases, tokens, redelivered = KEYS[2], KEYS[3], KEYS[4], KEYS[5], KEYS[6]
local scratch, remnant = KEYS[7], KEYS[10]
local groups_mode = ARGV[2] == 'groups'
local count, n, units = tonumber(ARGV[3]), tonumber(ARGV[4]), tonumber(ARGV[5])
local lease_ms = tonumber(ARGV[8])
local taken = groups_mode and gtaken or consumed
-- A bitmap longer than the dock is not one of ours (BITOP would count its extra bits as candidates).
local nbytes = math.ceil(units / 8)
local nlen, ntiers, fewer, cap = tonumber(ARGV[10]), tonumber(ARGV[11]), ARGV[12] == '1', tonumber(ARGV[13])
local nunready, bounded = tonumber(ARGV[14]), ARGV[15] ~= ''
local batch_groups = (ARGV[16] or '') ~= '' and groups_mode and tonumber(ARGV[16]) or nil
local tail = (ntiers > 0 and 1 or 0) + (bounded and 2 or 0) + ((ARGV[16] or '') ~= '' and 2 or 0)
local last_status = #KEYS - nlen - ntiers - 2 * nunready - tail   -- KEYS[11..last_status]: status bitmaps
local first_tier = last_status + nlen + 1
local first_unready = first_tier + ntiers
local at = first_unready + 2 * nunready                          -- the optional keys, in header order
local scratch2, scratch3, version_key, gversions, gversions_at, gbatch
if ntiers > 0 then scratch2 = KEYS[at]; at = at + 1 end
if bounded then version_key, gversions, gversions_at = KEYS[at], KEYS[at + 1], at + 1; at = at + 2 end
if (ARGV[16] or '') ~= '' then gbatch, scratch3 = KEYS[at], KEYS[at + 1] end
if batch_groups and not scratch2 then return redis.error_reply('ERR the iteration batch needs tiers') end
bad = wrong_type(8, #KEYS, 'string', gversions_at) or (gversions_at and wrong_type(gversions_at, gversions_at, 'zset'))
if bad then return redis.error_reply(bad) end
local fresh_from = nil
if bounded then
  local current, lost = current_version(KEYS[1], version_key)
  if not current then return redis.error_reply(lost) end
  fresh_from = current - tonumber(ARGV[15])
end
local too_long = longer_than(nbytes, taken, unpack(KEYS, 11, last_status))
if too_long then return redis.error_reply(too_long) end
local now = now_ms()
local _, corrupt = reclaim_expired(consumed, gtaken, remnant, leases, tokens, redelivered, n, now)
if corrupt then return redis.error_reply(corrupt) end
if cap > 0 and redis.call('BITCOUNT', consumed) >= cap then return {} end

-- scratch = NOT taken AND status_1 AND ... AND status_k. BITOP NOT only covers the bytes the taken
-- bitmap has, so pad it with 0xff up to the full size; bits past `units` are cleared by the AND
-- because no status bitmap ever sets them.
redis.call('BITOP', 'NOT', scratch, taken)
local have = redis.call('STRLEN', scratch)
if have < nbytes then
  redis.call('SETRANGE', scratch, have, string.rep('\255', nbytes - have))
end
redis.call('BITOP', 'AND', scratch, scratch, unpack(KEYS, 11, last_status))

-- Stale groups that would qualify are left out here, atomically with the pick, and reported: the
-- client discards them next (discard.lua), which checks their version again.
local stale = {}
if gversions then
  local old = redis.call('ZRANGEBYSCORE', gversions, '-inf', '(' .. int_text(fresh_from))
  for _, member in ipairs(old) do
    local g = tonumber(member)
    if groups_mode then
      if redis.call('GETBIT', scratch, g) == 1 then
        stale[#stale + 1] = g
        redis.call('SETBIT', scratch, g, 0)
      end
    else
      local _, any = group_states(scratch, {g}, n)
      if any[1] then
        stale[#stale + 1] = g
        set_runs(scratch, {g * n}, {n}, 0)
      end
    end
  end
end
local stale_text = table.concat(stale, ',')

-- The iteration's batch (ARGV[16], with tiers): the candidates already in it (scratch3) are taken
-- first; the others (left in scratch) count only as far as the batch has room for new groups.
local available
local from_batch = 0
if batch_groups then
  redis.call('BITOP', 'AND', scratch3, scratch, gbatch)
  redis.call('BITOP', 'XOR', scratch, scratch, scratch3)
  from_batch = redis.call('BITCOUNT', scratch3)
  local room = math.max(batch_groups - redis.call('BITCOUNT', gbatch), 0)
  available = from_batch + math.min(redis.call('BITCOUNT', scratch), room)
else
  available = redis.call('BITCOUNT', scratch)
end
if fewer and available > 0 and available < count then count = available end
if available < count or available == 0 then
  redis.call('DEL', scratch)
  if scratch2 then redis.call('DEL', scratch2) end
  if scratch3 then redis.call('DEL', scratch3) end
  if #stale > 0 then return {-1, '', '', stale_text, 0} end
  return {}
end

-- byte value -> offsets of its set bits, high bit (offset 0) first. Built only by the policies that
-- walk the whole candidate bitmap (random, seqlen): building it costs ~0.1 ms, as much as the rest of
-- a fifo pick.
local function offset_table()
  local offsets_in = {}
  for value = 0, 255 do
    local list, rest = {}, value
    for offset = 0, 7 do
      local weight = 2 ^ (7 - offset)
      if rest >= weight then list[#list + 1] = offset; rest = rest - weight end
    end
    offsets_in[value] = list
  end
  return offsets_in
end

-- Appends to `picked` the lowest set bits of bitmap `key` until it holds `count`: BITPOS skips to the
-- first one, then the bitmap is read in 64-byte chunks and decoded here, rather than one BITPOS and
-- SETBIT per unit.
local function fifo_pick(key, count, picked)
  local first = redis.call('BITPOS', key, 1)
  if first < 0 then return end
  local byte = math.floor(first / 8)
  while #picked < count do
    local chunk = redis.call('GETRANGE', key, byte, byte + 63)
    if #chunk == 0 then return end
    for i = 1, #chunk do
      local value = string.byte(chunk, i)
      for offset = 0, 7 do
        if value == 0 or #picked == count then break end
        local weight = 2 ^ (7 - offset)
        if value >= weight then
          value = value - weight
          picked[#picked + 1] = (byte + i - 1) * 8 + offset
        end
      end
      if #picked == count then break end
    end
    if #picked < count then
      local next_bit = redis.call('BITPOS', key, 1, byte + 64)
      if next_bit < 0 then return end
      byte = math.floor(next_bit / 8)
    end
  end
end

local picked_tier = nil   -- unit -> tier it was picked from, with tiers
local policy = ARGV[6]
if ntiers > 0 then policy = 'fifo' end
if policy == 'seqlen' and (nlen == 0 or available % count ~= 0) then policy = 'random' end

local picked = {}
if policy == 'seqlen' then
  local offsets_in = offset_table()
  local map, candidates = redis.call('GET', scratch), {}
  for i = 1, #map do
    for _, offset in ipairs(offsets_in[string.byte(map, i)]) do candidates[#candidates + 1] = (i - 1) * 8 + offset end
  end
  local arrays = {}
  for j = 1, nlen do arrays[j] = redis.call('GET', KEYS[last_status + j]) or '' end
  local rows_per = groups_mode and n or 1
  local cost = {}
  for i, unit in ipairs(candidates) do
    local c = 0
    for r = unit * rows_per, unit * rows_per + rows_per - 1 do
      for j = 1, nlen do c = c + u32_at(arrays[j], r) end
    end
    cost[i] = c
  end
  local order = {}
  for i = 1, #candidates do order[i] = i end
  table.sort(order, function(a, b)
    if cost[a] ~= cost[b] then return cost[a] > cost[b] end
    return a > b
  end)
  -- A binary min-heap of the batches by (total, units, number); the first batch to reach `count`
  -- units is the answer, so the deal stops there.
  local k = available / count
  local heap, members = {}, {}
  for b = 1, k do heap[b] = {0, 0, b}; members[b] = {} end
  local function less(x, y)
    if x[1] ~= y[1] then return x[1] < y[1] end
    if x[2] ~= y[2] then return x[2] < y[2] end
    return x[3] < y[3]
  end
  local function sift_down(i)
    while true do
      local l, r, m = 2 * i, 2 * i + 1, i
      if l <= #heap and less(heap[l], heap[m]) then m = l end
      if r <= #heap and less(heap[r], heap[m]) then m = r end
      if m == i then return end
      heap[i], heap[m] = heap[m], heap[i]
      i = m
    end
  end
  for _, i in ipairs(order) do
    local top = heap[1]
    top[1], top[2] = top[1] + cost[i], top[2] + 1
    local list = members[top[3]]
    list[#list + 1] = candidates[i]
    if top[2] == count then picked = list; break end
    sift_down(1)
  end
elseif policy == 'random' then
  -- Draw `count` distinct ranks among the available units (Floyd's algorithm), then walk the
  -- bitmap once to turn ranks into bit offsets. A Park-Miller generator is exact in doubles, so
  -- a seed gives the same pick on Redis and on fakeredis.
  local offsets_in = offset_table()
  local state = tonumber(ARGV[7]) % 2147483646 + 1
  local chosen, ranks = {}, {}
  for top = available - count, available - 1 do
    state = (state * 16807) % 2147483647
    local r = math.floor(state / 2147483647 * (top + 1))
    if chosen[r] then r = top end
    chosen[r] = true
    ranks[#ranks + 1] = r
  end
  table.sort(ranks)
  local map = redis.call('GET', scratch)
  local seen, want = 0, 1
  for i = 1, #map do
    local offsets = offsets_in[string.byte(map, i)]
    while ranks[want] ~= nil and ranks[want] < seen + #offsets do
      picked[want] = (i - 1) * 8 + offsets[ranks[want] - seen + 1]
      want = want + 1
    end
    if want > count then break end
    seen = seen + #offsets
  end
else
  -- Lowest units first, tier by tier (see ARGV[11]); the rest after the last tier. With the
  -- iteration's batch, its groups (scratch3) go through the tiers first, then the new ones (scratch).
  local tier_of = {}
  local function pick_by_tiers(candidates)
    for t = 1, ntiers do
      if #picked == count then return end
      redis.call('BITOP', 'AND', scratch2, candidates, KEYS[first_tier + t - 1])
      local before = #picked
      fifo_pick(scratch2, count, picked)
      for i = before + 1, #picked do tier_of[picked[i]] = t end
      if #picked == count then return end
      -- Not enough in this tier: take it out of the candidates (NOT, padded as above, then AND).
      redis.call('BITOP', 'NOT', scratch2, KEYS[first_tier + t - 1])
      local have2 = redis.call('STRLEN', scratch2)
      if have2 < nbytes then redis.call('SETRANGE', scratch2, have2, string.rep('\255', nbytes - have2)) end
      redis.call('BITOP', 'AND', candidates, candidates, scratch2)
    end
    if #picked < count then fifo_pick(candidates, count, picked) end
  end
  if from_batch > 0 then pick_by_tiers(scratch3) end
  pick_by_tiers(scratch)
  if ntiers > 0 then
    redis.call('DEL', scratch2)
    picked_tier = tier_of
  end
  if scratch3 then redis.call('DEL', scratch3) end
end
redis.call('DEL', scratch)
local last = picked[1]
for i = 2, #picked do last = math.max(last, picked[i]) end
if last >= units then
  return redis.error_reply('CORRUPT a status bitmap of ' .. KEYS[1] .. "'s dock has bits set past its "
    .. units .. ' ' .. ARGV[2])
end

local starts, lengths = runs_of(picked)
if groups_mode then
  for i = 1, #starts do starts[i], lengths[i] = starts[i] * n, lengths[i] * n end
  -- Groups picked that came back in part (marked in the remnant bitmap, which exists only while some
  -- group is so marked): of them only the rows not handed out go; their acked rows are done. The mark
  -- is a hint (a clear of rows may leave it behind): the row bits decide.
  if redis.call('EXISTS', remnant) == 1 then
    local marks, partly, is_partly = get_bits(remnant, picked), {}, {}
    for i = 1, #picked do
      if marks[i] == 1 then partly[#partly + 1] = picked[i]; is_partly[picked[i]] = true end
    end
    if #partly > 0 then
      local rows = unconsumed_rows_of_groups(consumed, partly, n)
      for _, g in ipairs(picked) do
        if not is_partly[g] then
          for r = g * n, g * n + n - 1 do rows[#rows + 1] = r end
        end
      end
      set_bits(remnant, partly, 0)
      if redis.call('BITCOUNT', remnant) == 0 then redis.call('DEL', remnant) end
      -- Every group picked is handed out now, even one with no row left to hand out (none such is made,
      -- see include/leases.lua; were one, it must not be picked again and again for nothing).
      set_bits(gtaken, picked, 1)
      if #rows == 0 then return {} end
      starts, lengths = runs_of(rows)
    end
  end
end
mark_runs_taken(consumed, gtaken, starts, lengths, n)
if batch_groups then set_bits(gbatch, picked, 1) end
local rows = rows_of_runs(starts, lengths)
if lease_ms > 0 then lease_rows(leases, tokens, rows, now + lease_ms, ARGV[9]) end
for u = 1, nunready do
  set_runs(KEYS[first_unready + 2 * u - 2], starts, lengths, 0)
  set_bits(KEYS[first_unready + 2 * u - 1], groups_of_runs(starts, lengths, n), 0)
end
local tiers = ''
if picked_tier then
  local list = {}
  for i, r in ipairs(rows) do list[i] = picked_tier[groups_mode and math.floor(r / n) or r] or 0 end
  tiers = table.concat(list, ',')
end
local epoch = epoch_of(KEYS[8])
local generations = generations_of_runs(KEYS[9], starts, lengths)
local runs = {}
for i = 1, #starts do runs[2 * i - 1], runs[2 * i] = starts[i], lengths[i] end
local reply = {epoch, generations, tiers, stale_text, available - count}
for i = 1, #runs do reply[i + 5] = runs[i] end
return keep_reply(reply_key, reply_ttl, reply)

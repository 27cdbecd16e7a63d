--[[ clear: forget rows, or the whole dock, or end a partial-rollout iteration.

Readers that were handed the rows before the clear see it at their read (the epoch or the rows'
generations changed, see include/generations.lua) and never get the bytes written after it. Leases of
the rows end with them, so an ack from before the clear releases nothing written since.

KEYS        the dock's keys in the layout of include/forget.lua, then td:{NAME}:scratch and
            td:{NAME}:scratch2 (work space, deleted before returning)
ARGV[1]     the schema the client expects (see include/schema.lua)
ARGV[2..6]  k, m, n_samples_per_prompt, L, A (see include/forget.lua)
ARGV[7]     what to clear:
            "all"        every row, and the batch's keys (cursor, metrics, discarded counts);
            "rows"       the rows in ARGV[8..], decimal;
            "iteration"  the end of a partial-rollout iteration (MindSpeed's clear(consumer)): the rows
                         handed to the consumer at position ARGV[8] (1..m) are forgotten, every group
                         kept grows one iteration older, and the cursor and metrics start again. If
                         the consumer was handed nothing, nothing ages (MindSpeed's first clear).
            "share"      the same, in one partition of a partitioned dock whose iteration trained rows in
                         some partition (broker/api/partitioned_generation.py): the groups kept here age
                         even if this partition handed the consumer nothing;
            "trained"    the same without the ageing (the queue's refine_topic_for_partial_rollout);
            "age"        only the ageing (the queue's increment_ages), of every group holding a
                         response or its placeholder, as the queue ages them.
            For these ARGV[9] is the position (1..k) of the first response column, 0 if none.
last        how long to keep the reply, in ms; and td:{NAME}:reply:REQUEST_ID as the last key
            (include/once.lua): a resend after a lost reply neither clears the next batch's rows
            nor ages the groups twice

Waiting: a prompt no rollout reached in its iteration does not age (MindSpeed ages rows once they were
generated), yet MindSpeed's re-sort keeps it ahead of every prompt put after it. Here such groups go
into td:{NAME}:gwait:W (waited W clears; rows in wait:W), which sampling takes after the aged groups
and before the rest, so a new prompt in a lower free group never overtakes it.

Ageing is a rename of the age bitmaps (age:a becomes age:a+1, the oldest two merge), not a pass over
rows: MindSpeed re-sorts its whole dock by age here, copying every row, so that "oldest first" is
"lowest index first"; the bitmaps give sampling the same order (see sample.lua's tiers) and leave the
rows where they are.

Returns the number of cells removed from data hashes; on a sharded dock, that with what the client must
delete from the data shards (see include/forget.lua forgotten_reply).
]]
-- @include bits
-- @include schema
-- @include generations
-- @include forget
-- @include once

local reply_key, reply_ttl = once_args()
local kept = kept_reply(reply_key)
if kept then return kept end

local wrong_schema = schema_error(KEYS[1], ARGV[1])
if wrong_schema then return redis.error_reply(wrong_schema) end
local L = forget_layout()
local mode = ARGV[7]

if mode == 'all' then
  local bad = wrong_type(2, 2, 'string')
  if bad then return redis.error_reply(bad) end
  local cells = 0
  for c = 1, L.k do
    if redis.call('TYPE', KEYS[L.data + c])['ok'] == 'hash' then cells = cells + redis.call('HLEN', KEYS[L.data + c]) end
  end
  local before = epoch_of(KEYS[2])
  redis.call('DEL', unpack(KEYS, 4))
  if L.quota then redis.call('HSET', KEYS[1], 'stored_bytes', 0) end   -- include/quota.lua
  redis.call('INCR', KEYS[2])
  return keep_reply(reply_key, reply_ttl, forgotten_reply(L, cells, before))   -- sharded: the client deletes the data keys of that epoch
end

local bad = forget_wrong_type(L)
if bad then return redis.error_reply(bad) end

if mode == 'rows' then
  return keep_reply(reply_key, reply_ttl, forgotten_reply(L, forget_rows(L, numbers_from(8), {}, false)))
end

local cells = 0
local scratch, scratch2 = KEYS[#KEYS - 1], KEYS[#KEYS]
local responses = tonumber(ARGV[9] or '0')

-- KEYS[first + 1 + a] for a = lo .. hi holds age (or wait) a: every bitmap moves up one, the top two
-- merge, and `lo` is left empty. A RENAME, not a pass over rows.
local function older(first, lo, hi)
  local function key(a) return KEYS[first + 1 + a] end
  if hi <= lo then return end                         -- one bitmap: it keeps what it has
  if redis.call('EXISTS', key(hi - 1)) == 1 then      -- the oldest two merge
    if redis.call('EXISTS', key(hi)) == 1 then
      redis.call('BITOP', 'OR', key(hi), key(hi), key(hi - 1))
      redis.call('DEL', key(hi - 1))
    else
      redis.call('RENAME', key(hi - 1), key(hi))
    end
  end
  for a = hi - 1, lo + 1, -1 do                       -- a-1 becomes a
    if redis.call('EXISTS', key(a - 1)) == 1 then
      redis.call('RENAME', key(a - 1), key(a))
    else
      redis.call('DEL', key(a))
    end
  end
  redis.call('DEL', key(lo))
end

-- dest = dest AND NOT other, as two BITOPs (XOR of what they share): BITOP NOT would need padding to
-- the dock's size, which this script does not know.
local function remove(dest, other)
  redis.call('BITOP', 'AND', scratch2, dest, other)
  redis.call('BITOP', 'XOR', dest, dest, scratch2)
end

-- Groups holding a prompt (the placeholder of the first response column) that never had a response put.
local function never_generated()
  redis.call('BITOP', 'AND', scratch, KEYS[L.gready + responses], KEYS[L.gready + responses])
  remove(scratch, KEYS[L.grolled])
end

if mode == 'age' then
  -- The queue ages every row with a response or its placeholder: such groups start ageing now.
  if responses > 0 then
    never_generated()
    local groups = offsets_of(scratch)
    set_bits(KEYS[L.grolled], groups, 1)
    set_bits(KEYS[L.gage + 1], groups, 1)
    set_bits(KEYS[L.age + 1], rows_of_groups(groups, L.n), 1)
  end
else                                        -- 'iteration', 'share' or 'trained'
  local trained = offsets_of(KEYS[L.consumed + tonumber(ARGV[8])])
  redis.call('DEL', KEYS[L.cursor], KEYS[L.metrics], KEYS[L.gbatch])   -- the next iteration's batch is new
  -- As MindSpeed's: an iteration that trained nothing (the first clear, before any batch) ages nothing;
  -- a partition's share of an iteration that trained elsewhere ages.
  if #trained == 0 and mode ~= 'share' then return keep_reply(reply_key, reply_ttl, forgotten_reply(L, 0)) end
  if #trained > 0 then cells = forget_rows(L, trained, {}, false) end
  if mode == 'trained' then return keep_reply(reply_key, reply_ttl, forgotten_reply(L, cells)) end
  if L.nwait > 0 and responses > 0 then
    -- Waiting groups that were generated since leave the wait bitmaps: from now on they age.
    local aged_rows = {}
    for a = 1, L.nages do aged_rows[a] = KEYS[L.age + a] end
    redis.call('BITOP', 'OR', scratch, unpack(aged_rows))
    for w = 1, L.nwait do
      remove(KEYS[L.gwait + w], KEYS[L.grolled])
      remove(KEYS[L.wait + w], scratch)
    end
    older(L.wait - 1, 1, L.nwait)
    older(L.gwait - 1, 1, L.nwait)
    -- Prompts that waited through this clear for the first time.
    never_generated()
    for w = 2, L.nwait do remove(scratch, KEYS[L.gwait + w]) end
    local groups = offsets_of(scratch)
    set_bits(KEYS[L.gwait + 1], groups, 1)
    set_bits(KEYS[L.wait + 1], rows_of_groups(groups, L.n), 1)
  end
end
-- Ageing: every group that was generated grows one iteration older.
older(L.age, 0, L.nages - 1)
older(L.gage, 0, L.nages - 1)
redis.call('DEL', scratch, scratch2)
return keep_reply(reply_key, reply_ttl, forgotten_reply(L, cells))

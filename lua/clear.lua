--[[ clear: forget rows, or the whole dock, or end a partial-rollout iteration.

Readers that were handed the rows before the clear see it at their read (the epoch or the rows'
generations changed, see include/generations.lua) and never get the bytes written after it. Leases of
the rows end with them, so an ack from before the clear releases nothing written since.

KEYS        the dock's keys in the layout of include/forget.lua
ARGV[1]     the schema the client expects (see include/schema.lua)
ARGV[2..6]  k, m, n_samples_per_prompt, L, A (see include/forget.lua)
ARGV[7]     what to clear:
            "all"        every row, and the batch's keys (cursor, metrics, discarded counts);
            "rows"       the rows in ARGV[8..], decimal;
            "iteration"  the end of a partial-rollout iteration (MindSpeed's clear(consumer)): the rows
                         handed to the consumer at position ARGV[8] (1..m) are forgotten, every group
                         kept grows one iteration older, and the cursor and metrics start again. If
                         the consumer was handed nothing, nothing ages (MindSpeed's first clear).
            "trained"    the same without the ageing (the queue's refine_topic_for_partial_rollout);
            "age"        only the ageing (the queue's increment_ages).

Ageing is a rename of the age bitmaps (age:a becomes age:a+1, the oldest two merge), not a pass over
rows: MindSpeed re-sorts its whole dock by age here, copying every row, so that "oldest first" is
"lowest index first"; the bitmaps give sampling the same order (see sample.lua's tiers) and leave the
rows where they are.

Returns the number of cells removed from data hashes.
]]
-- @include bits
-- @include schema
-- @include forget

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
  redis.call('DEL', unpack(KEYS, 4))
  redis.call('INCR', KEYS[2])
  return cells
end

local bad = forget_wrong_type(L)
if bad then return redis.error_reply(bad) end

if mode == 'rows' then
  return forget_rows(L, numbers_from(8), {}, false)
end

local cells = 0
if mode ~= 'age' then                       -- 'iteration' or 'trained'
  local trained = offsets_of(KEYS[L.consumed + tonumber(ARGV[8])])
  redis.call('DEL', KEYS[L.cursor], KEYS[L.metrics])
  -- As MindSpeed's: an iteration that trained nothing (the first clear, before any batch) ages nothing.
  if #trained == 0 then return 0 end
  cells = forget_rows(L, trained, {}, false)
  if mode == 'trained' then return cells end
end
-- Ageing: every group kept grows one iteration older.
local function older(first)
  local function key(a) return KEYS[first + 1 + a] end  -- the bitmap of age a
  local top = L.nages - 1
  if top < 1 then return end
  if redis.call('EXISTS', key(top - 1)) == 1 then      -- the oldest two merge
    if redis.call('EXISTS', key(top)) == 1 then
      redis.call('BITOP', 'OR', key(top), key(top), key(top - 1))
      redis.call('DEL', key(top - 1))
    else
      redis.call('RENAME', key(top - 1), key(top))
    end
  end
  for a = top - 1, 1, -1 do                             -- age a-1 becomes age a
    if redis.call('EXISTS', key(a - 1)) == 1 then
      redis.call('RENAME', key(a - 1), key(a))
    else
      redis.call('DEL', key(a))
    end
  end
  redis.call('DEL', key(0))
end
older(L.age)
older(L.gage)
return cells

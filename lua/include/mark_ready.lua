--[[ mark_ready: set the ready bits of rows just written, pasted in by `-- @include mark_ready` (put.lua, mark.lua).

Both scripts end a put: put.lua inside the MULTI that wrote the bytes (one node, the whole dock in one
slot), mark.lua after the bytes were written to the data shards of a sharded dock (see mark.lua).
]]
-- @include bits

-- Marks the rows of the runs ready in the columns whose row and group bitmaps are ready_keys[i] and
-- gready_keys[i], stores the values of the length columns (len_keys[j]: u32 array; values of the j-th
-- start at ARGV[values_at + (j - 1) * rows]), then announces the put on `channel` with `publish`
-- (PUBLISH, or SPUBLISH on a Redis 7 cluster: see broker/control/scripts/). Returns the number of rows written.
--
-- The announcement goes last and through redis.pcall: a refused PUBLISH (an ACL user without the
-- channel, the default for a new Redis 7 user; the command renamed) aborted the script with its marks
-- in place, so every put raised and every put landed. It is only a wake-up (waiting readers also look
-- again on a timer, see broker/control/put_listener.py), so a refusal is ignored here; the dock says so once
-- when it opens (broker/control/server_checks.py).
local function mark_ready(ready_keys, gready_keys, len_keys, values_at, starts, lengths, n, publish, channel)
  local written = 0
  for i = 1, #lengths do written = written + lengths[i] end
  local groups = groups_of_runs(starts, lengths, n)
  local rows = rows_of_runs(starts, lengths)
  for j = 1, #len_keys do
    local values, first = {}, values_at + (j - 1) * #rows
    for i = 1, #rows do values[i] = ARGV[first + i - 1] end
    set_u32(len_keys[j], rows, values)
  end
  for c = 1, #ready_keys do
    set_runs(ready_keys[c], starts, lengths, 1)
    -- A put only adds rows, so it can complete groups but never break one.
    local full = group_states(ready_keys[c], groups, n)
    local done = {}
    for i = 1, #groups do
      if full[i] then done[#done + 1] = groups[i] end
    end
    set_bits(gready_keys[c], done, 1)
  end
  redis.pcall(publish, channel, written)
  return written
end

--[[ delivery: the write fence, pasted in by `-- @include delivery` (put.lua, claim.lua, mark.lua,
discard.lua).

Rows handed out by sample.lua or take.lua go to the client with the dock's epoch and their generations
(include/generations.lua) and, under a lease, the lease's token (include/leases.lua): together they
name one delivery. A write naming a delivery (a stage putting its results into the rows it was handed,
a filter dropping the groups it rejected) lands only while that delivery is still current, as Kafka
fences a zombie producer by its epoch and SQS refuses a receipt handle once the message went to
another consumer:
- no clear touched the rows since they were handed out (epoch and generations unchanged), nor a
  checkpoint's restore (restore.lua moves the epoch forward); else the rows may hold the next batch's
  prompts, and a late result would be paired with them;
- under a lease, every row is still leased under the delivery's token; else the lease ran out and the
  rows were given back (to be redone by another worker, whose result a late write would overwrite),
  or they were acked, or another call took them over.
A lease past its deadline whose rows nobody gave back yet is still its holder's, for a write as for an
ack: the deadline says when the rows may go to someone else, not that they have.
]]
-- @include bits
-- @include generations
-- @include leases

local function listed(rows)
  local shown = {}
  for i = 1, math.min(#rows, 8) do shown[i] = rows[i] end
  return table.concat(shown, ', ') .. (#rows > 8 and (', ... (' .. #rows .. ' rows)') or '')
end

-- nil if the delivery (its `epoch`, the `generations` of the runs' rows in run order, the `token` of its
-- lease or "" for none) still holds the rows of the runs; else a FENCED error message naming the rows
-- and why. `tokens_key` is the delivery consumer's td:{NAME}:tokens:CONSUMER (unused without a token).
local function fenced_off(epoch_key, gen_key, tokens_key, epoch, generations, token, starts, lengths)
  -- The usual case, nothing moved, in one comparison of strings; row by row only to name what did.
  local same_epoch = epoch_of(epoch_key) == epoch
  if not (same_epoch and generations_of_runs(gen_key, starts, lengths) == generations) then
    local kept, moved = {}, {}
    for _, r in ipairs(unchanged_rows(epoch_key, gen_key, epoch, generations, starts, lengths)) do kept[r] = true end
    for _, r in ipairs(rows_of_runs(starts, lengths)) do
      if not kept[r] then moved[#moved + 1] = r end
    end
    return 'FENCED rows ' .. listed(moved) .. ' were cleared or dropped since this delivery handed them out '
      .. '(or the dock was restored from a checkpoint): they may hold other prompts now; nothing was written'
  end
  if token == '' then return nil end
  local rows = rows_of_runs(starts, lengths)
  local holders = holders_of(tokens_key, rows)
  local lost = {}
  for i = 1, #rows do
    if holders[i] ~= token then lost[#lost + 1] = rows[i] end
  end
  if #lost == 0 then return nil end
  return 'FENCED rows ' .. listed(lost) .. ' are no longer leased to this delivery (the lease ran out and they '
    .. 'were given back to be redone, or they were acked or taken over); nothing was written'
end

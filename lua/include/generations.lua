--[[ generations: the read fence, pasted in by `-- @include generations`.

Handing rows out (a script) and reading their bytes (HMGET) are two round trips, and a clear can land
between them. So every row has a generation, and the dock an epoch: a whole clear bumps the epoch
(td:{NAME}:epoch, a counter; a checkpoint's restore moves it past the dock's and the saved one,
restore.lua), a clear of some rows bumps their generations (td:{NAME}:gen, an array
of big-endian u32, row r at bytes [4r, 4r+4), as `BITFIELD ... u32 #r` reads it). Puts change
neither, so a put never invalidates a reader. Sampling returns the epoch and generations of the rows
it hands out; the read checks them again right after its HMGETs, in the same pipeline, and a changed
value means the row was cleared since it was handed out (its bytes gone or replaced by the next
batch's). The epoch only ever grows, and a row's generation within an epoch (a u32 wraps after 2^32
clears of one row, not within one round trip), so values unchanged after the read mean no clear came
between handout and read, as a seqlock reader concludes.
]]
-- @include bits

-- The epoch of the dock: when it was made (create.lua), counted up by whole clears and moved forward by a
-- restore (restore.lua); 0 for a dock made before epochs started there.
local function epoch_of(key)
  return tonumber(redis.call('GET', key) or '0')
end

-- The generations of the rows of the runs, as a string of 4 bytes per row in run order. A missing
-- or short array reads as zeros.
local function generations_of_runs(key, starts, lengths)
  local parts = {}
  for i = 1, #starts do
    local want = 4 * lengths[i]
    local got = redis.call('GETRANGE', key, 4 * starts[i], 4 * (starts[i] + lengths[i]) - 1)
    if #got < want then got = got .. string.rep('\0', want - #got) end
    parts[i] = got
  end
  return table.concat(parts)
end

-- Adds 1 to the generation of every row of `rows` (wrapping at 2^32).
local function bump_generations(key, rows)
  local args = {}
  for i = 1, #rows do
    args[#args + 1] = 'INCRBY'; args[#args + 1] = 'u32'; args[#args + 1] = '#' .. rows[i]; args[#args + 1] = 1
  end
  bitfield_batch(key, args, 4)
end

-- The runs' rows whose epoch and generation still equal `epoch` and `generations` (as returned by
-- generations_of_runs when they were handed out): the rows no clear has touched since.
local function unchanged_rows(epoch_key, gen_key, epoch, generations, starts, lengths)
  local rows = {}
  if epoch_of(epoch_key) ~= epoch then return rows end
  local now = generations_of_runs(gen_key, starts, lengths)
  local at = 1
  for i = 1, #starts do
    for r = starts[i], starts[i] + lengths[i] - 1 do
      if string.sub(now, at, at + 3) == string.sub(generations, at, at + 3) then rows[#rows + 1] = r end
      at = at + 4
    end
  end
  return rows
end

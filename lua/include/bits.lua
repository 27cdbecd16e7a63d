--[[ bits: helpers pasted into a script by its `-- @include bits` line.

Redis runs Lua 5.1 and fakeredis has no `bit` library, so bits are read and written by the server
with BITFIELD, batched: one call carries many sub-commands, cut into chunks because Lua's unpack()
is limited to a few thousand values. Bit offsets follow Redis: bit 0 is the high bit of byte 0.
]]

local BITFIELD_CHUNK = 1200   -- sub-commands per BITFIELD call
-- Values per unpack(): Lua 5.1's unpack() pushes every value on the C stack, whose limit
-- (LUAI_MAXCSTACK, 8000) a command with more arguments would pass.
local UNPACK_CHUNK = 1000

-- An integer as decimal text, exact up to 2^53. Lua's own conversion (`..`, tostring) keeps 14
-- significant digits: a version of 16 digits would become "1.7e+15" in a command's argument.
local function int_text(x)
  return string.format('%.0f', x)
end

-- The first of KEYS[first..last] (but KEYS[skip]) holding another type than `expected` (a missing
-- key is fine), as a CORRUPT error message for redis.error_reply, or nil. Scripts are not rolled back
-- on error, so they check before their first write; the client turns CORRUPT into its decode error.
local function wrong_type(first, last, expected, skip)
  for i = first, last do
    local t = i ~= skip and redis.call('TYPE', KEYS[i])['ok'] or 'none'
    if t ~= 'none' and t ~= expected then
      return 'CORRUPT ' .. KEYS[i] .. ' holds a ' .. t .. ', expected a ' .. expected
    end
  end
  return nil
end

-- The first of the keys given (bitmaps) longer than `nbytes`, as a CORRUPT error message, or nil: a
-- bitmap with bits past the dock's last row or group was not written by the broker.
local function longer_than(nbytes, ...)
  for _, key in ipairs({...}) do
    local have = redis.call('STRLEN', key)
    if have > nbytes then
      return 'CORRUPT ' .. key .. ' holds ' .. have .. ' bytes, more than the ' .. nbytes .. ' of its dock'
    end
  end
  return nil
end

-- Runs BITFIELD on `key` with `args`, a flat list of sub-commands of `width` arguments each.
local function bitfield_batch(key, args, width)
  local out = {}
  local step = BITFIELD_CHUNK * width
  for first = 1, #args, step do
    local last = math.min(first + step - 1, #args)
    local reply = redis.call('BITFIELD', key, unpack(args, first, last))
    for i = 1, #reply do out[#out + 1] = reply[i] end
  end
  return out
end

-- Runs `command` on `key` with every value of `values` as arguments, in chunks (Lua's unpack() is
-- limited to a few thousand values); returns the sum of the integer replies.
local function call_in_chunks(command, key, values)
  local total = 0
  for first = 1, #values, UNPACK_CHUNK do
    total = total + redis.call(command, key, unpack(values, first, math.min(first + UNPACK_CHUNK - 1, #values)))
  end
  return total
end

-- HMGET of `fields` of hash `key`, in chunks like call_in_chunks; returns the values in order.
local function hmget_in_chunks(key, fields)
  local out = {}
  for first = 1, #fields, UNPACK_CHUNK do
    local got = redis.call('HMGET', key, unpack(fields, first, math.min(first + UNPACK_CHUNK - 1, #fields)))
    for i = 1, #got do out[#out + 1] = got[i] end
  end
  return out
end

-- Sets bits [starts[i], starts[i] + lengths[i]) of `key` to `value` (0 or 1), a word of up to 32
-- bits per BITFIELD sub-command: its cost is per sub-command, and rows mostly come in runs
-- (whole groups, FIFO picks), so a run of 128 rows costs 4 sub-commands instead of 128.
local function set_runs(key, starts, lengths, value)
  local args = {}
  for i = 1, #starts do
    local offset, left = starts[i], lengths[i]
    while left > 0 do
      local width = math.min(left, 32)
      args[#args + 1] = 'SET'; args[#args + 1] = 'u' .. width; args[#args + 1] = offset
      args[#args + 1] = (value == 1) and (2 ^ width - 1) or 0
      offset, left = offset + width, left - width
    end
  end
  bitfield_batch(key, args, 4)
end

-- Runs of consecutive values in `offsets`, as two lists (starts, lengths), in ascending order.
local function runs_of(offsets)
  local sorted = {}
  for i = 1, #offsets do sorted[i] = offsets[i] end
  table.sort(sorted)
  local starts, lengths = {}, {}
  for i = 1, #sorted do
    local v, last = sorted[i], #starts
    if last > 0 and v == starts[last] + lengths[last] then
      lengths[last] = lengths[last] + 1
    elseif last == 0 or v >= starts[last] + lengths[last] then
      starts[last + 1], lengths[last + 1] = v, 1
    end
  end
  return starts, lengths
end

-- Sets bit `offset` of `key` to `value` for every offset in `offsets` (in any order, repeats allowed).
local function set_bits(key, offsets, value)
  local starts, lengths = runs_of(offsets)
  set_runs(key, starts, lengths, value)
end

-- Runs given in ARGV[first..] as pairs: start, length.
local function runs_from(first)
  local starts, lengths = {}, {}
  for i = first, #ARGV, 2 do
    starts[#starts + 1] = tonumber(ARGV[i]); lengths[#lengths + 1] = tonumber(ARGV[i + 1])
  end
  return starts, lengths
end

-- Every row of the runs, ascending.
local function rows_of_runs(starts, lengths)
  local rows = {}
  for i = 1, #starts do
    for r = starts[i], starts[i] + lengths[i] - 1 do rows[#rows + 1] = r end
  end
  return rows
end

-- Distinct groups (row // n) touched by the runs, ascending.
local function groups_of_runs(starts, lengths, n)
  local groups = {}
  for i = 1, #starts do
    local first, last = math.floor(starts[i] / n), math.floor((starts[i] + lengths[i] - 1) / n)
    if #groups > 0 and groups[#groups] >= first then first = groups[#groups] + 1 end
    for g = first, last do groups[#groups + 1] = g end
  end
  return groups
end

-- Reads bit `offset` of `key` for every offset in `offsets`.
local function get_bits(key, offsets)
  local args = {}
  for i = 1, #offsets do
    args[#args + 1] = 'GET'; args[#args + 1] = 'u1'; args[#args + 1] = offsets[i]
  end
  return bitfield_batch(key, args, 3)
end

-- Distinct groups (row // n) of `rows`, in order of first appearance.
local function groups_of(rows, n)
  local seen, groups = {}, {}
  for i = 1, #rows do
    local g = math.floor(rows[i] / n)
    if not seen[g] then seen[g] = true; groups[#groups + 1] = g end
  end
  return groups
end

-- For each group g of `groups`, reads the n row bits [g*n, (g+1)*n) of `key` in 32-bit words
-- (wider words would lose precision in Lua's doubles). Returns two lists aligned with `groups`:
-- whether all n bits are set, and whether any is.
local function group_states(key, groups, n)
  if n % 8 == 0 and #groups > 0 then
    -- Byte-aligned groups: one GETRANGE and string compares instead of a BITFIELD word per group.
    local lo, hi = groups[1], groups[1]
    for i = 2, #groups do lo = math.min(lo, groups[i]); hi = math.max(hi, groups[i]) end
    local width = n / 8
    local bytes = redis.call('GETRANGE', key, lo * width, (hi + 1) * width - 1)
    local ones, zeros = string.rep('\255', width), string.rep('\0', width)
    local full, any = {}, {}
    for i, g in ipairs(groups) do
      local at = (g - lo) * width + 1
      local piece = string.sub(bytes, at, at + width - 1)
      full[i] = piece == ones
      any[i] = piece ~= '' and piece ~= string.sub(zeros, 1, #piece)
    end
    return full, any
  end
  local args = {}
  for _, g in ipairs(groups) do
    for off = 0, n - 1, 32 do
      args[#args + 1] = 'GET'; args[#args + 1] = 'u' .. math.min(32, n - off); args[#args + 1] = g * n + off
    end
  end
  local words = bitfield_batch(key, args, 3)
  local full, any, w = {}, {}, 1
  for i = 1, #groups do
    full[i], any[i] = true, false
    for off = 0, n - 1, 32 do
      local width = math.min(32, n - off)
      if words[w] ~= 2 ^ width - 1 then full[i] = false end
      if words[w] ~= 0 then any[i] = true end
      w = w + 1
    end
  end
  return full, any
end

-- Marks the rows of the runs handed out in a consumer's row bitmap and their groups in its group bitmap.
local function mark_runs_taken(consumed_key, gtaken_key, starts, lengths, n)
  set_runs(consumed_key, starts, lengths, 1)
  set_bits(gtaken_key, groups_of_runs(starts, lengths, n), 1)
end

-- mark_runs_taken for rows in any order.
local function mark_taken(consumed_key, gtaken_key, rows, n)
  local starts, lengths = runs_of(rows)
  mark_runs_taken(consumed_key, gtaken_key, starts, lengths, n)
end

-- The reverse of mark_taken: clears `rows` in the consumer's row bitmap, and the bit of each of their
-- groups left with no row handed out (other rows of a group may still be out).
local function give_back(consumed_key, gtaken_key, rows, n)
  set_bits(consumed_key, rows, 0)
  local groups = groups_of(rows, n)
  local _, any = group_states(consumed_key, groups, n)
  local free = {}
  for i = 1, #groups do
    if not any[i] then free[#free + 1] = groups[i] end
  end
  set_bits(gtaken_key, free, 0)
end

-- After rows of `groups` handed out as whole groups were given back (give_back) while other rows of
-- theirs stay handed out (acked: their results are final): offers the groups to group sampling again
-- all the same, their bit in the consumer's group bitmap cleared, and marks in `remnant_key` those
-- with a row still handed out, so that sampling hands out only their other rows (see sample.lua). A
-- group with no row handed out any more is a whole group again (give_back cleared its bit already).
local function reoffer_groups(consumed_key, gtaken_key, remnant_key, groups, n)
  if #groups == 0 then return end
  local _, any = group_states(consumed_key, groups, n)
  local partly = {}
  for i = 1, #groups do
    if any[i] then partly[#partly + 1] = groups[i] end
  end
  set_bits(remnant_key, partly, 1)
  set_bits(gtaken_key, partly, 0)
end

-- ARGV[first..] as numbers.
local function numbers_from(first)
  local out = {}
  for i = first, #ARGV do out[#out + 1] = tonumber(ARGV[i]) end
  return out
end

-- Sets the u32 number `index` (bits 32*index .. 32*index+31, big-endian) of `key` to values[i] for
-- each indexes[i]: the arrays of length columns (td:{NAME}:len:COLUMN).
local function set_u32(key, indexes, values)
  local args = {}
  for i = 1, #indexes do
    args[#args + 1] = 'SET'; args[#args + 1] = 'u32'; args[#args + 1] = '#' .. indexes[i]
    args[#args + 1] = values[i]
  end
  bitfield_batch(key, args, 4)
end

-- The u32 number `index` of a string read whole with GET (0 past its end), as set_u32 wrote it.
local function u32_at(s, index)
  local at = index * 4 + 1
  if at + 3 > #s then return 0 end
  local a, b, c, d = string.byte(s, at, at + 3)
  return ((a * 256 + b) * 256 + c) * 256 + d
end

-- The offsets of the set bits of bitmap `key`, ascending: one GET and a walk of its bytes, skipping
-- zero bytes, so the cost is its size plus one step per bit set.
local function offsets_of(key)
  local map, out = redis.call('GET', key) or '', {}
  for i = 1, #map do
    local value = string.byte(map, i)
    if value ~= 0 then
      for offset = 0, 7 do
        local weight = 2 ^ (7 - offset)
        if value >= weight then
          value = value - weight
          out[#out + 1] = (i - 1) * 8 + offset
        end
      end
    end
  end
  return out
end

-- The rows of `groups` (n rows each), ascending when `groups` is.
local function rows_of_groups(groups, n)
  local rows = {}
  for _, g in ipairs(groups) do
    for r = g * n, g * n + n - 1 do rows[#rows + 1] = r end
  end
  return rows
end

-- The rows of `groups` not set in the consumer's row bitmap `consumed_key`, ascending when `groups` is:
-- what group sampling hands out of groups marked in its remnant bitmap.
local function unconsumed_rows_of_groups(consumed_key, groups, n)
  local rows = rows_of_groups(groups, n)
  local bits = get_bits(consumed_key, rows)
  local out = {}
  for i = 1, #rows do
    if bits[i] == 0 then out[#out + 1] = rows[i] end
  end
  return out
end

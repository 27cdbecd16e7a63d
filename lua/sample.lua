--[[ sample: pick rows that are written in every requested column and not yet handed to this
consumer, mark them handed to it, and return them; all or nothing.

Works on whole groups (the n responses of one prompt) or on single rows. Everything is bitmap
algebra on the server, so the cost grows with the bitmap bytes (capacity / 8), not with rows.
First it gives back rows whose lease expired unacked, so they are offered again.

A call carries a request id; its reply is kept for a short while under the reply key, and a call
repeating the id gets the kept reply instead of new rows. A client whose connection dropped after
the script ran retries with the same id and loses nothing.

KEYS[1]     td:{NAME}:consumed:CONSUMER      row bitmap: rows handed to the consumer
KEYS[2]     td:{NAME}:gtaken:CONSUMER        group bitmap: groups with any row handed to the consumer
KEYS[3]     td:{NAME}:leases:CONSUMER        sorted set: leased rows by deadline (ms)
KEYS[4]     td:{NAME}:redelivered:CONSUMER   counter of rows given back after their lease expired
KEYS[5]     td:{NAME}:reply:REQUEST_ID       the kept reply of this call
KEYS[6]     td:{NAME}:scratch                work space, deleted before returning
KEYS[7..]   per requested column: td:{NAME}:gready:COLUMN in group mode,
            td:{NAME}:ready:COLUMN in row mode
ARGV[1]     mode: "groups" or "rows"
ARGV[2]     how many units (groups or rows) to pick
ARGV[3]     n_samples_per_prompt
ARGV[4]     units in the dock: prompts_num in group mode, capacity in row mode
ARGV[5]     policy: "fifo" (lowest units first) or "random"
ARGV[6]     seed of the random policy, an integer in [0, 2^31)
ARGV[7]     lease in ms; 0 hands rows out for good
ARGV[8]     how long to keep the reply, in ms

Returns the picked rows as runs {start, length, start, length, ...}, ascending (a batch of whole
groups is a few runs, not a list of every row), or an empty list if fewer units qualify than asked.
]]
-- @include bits
-- @include leases

local kept = redis.call('GET', KEYS[5])
if kept then
  local reply = {}
  for number in string.gmatch(kept, '%d+') do reply[#reply + 1] = tonumber(number) end
  return reply
end

local bad = wrong_type(1, 2, 'string') or wrong_type(3, 3, 'zset') or wrong_type(4, 4, 'string')
  or wrong_type(7, #KEYS, 'string')
if bad then return redis.error_reply(bad) end

local consumed, gtaken, leases, redelivered, scratch = KEYS[1], KEYS[2], KEYS[3], KEYS[4], KEYS[6]
local groups_mode = ARGV[1] == 'groups'
local count, n, units = tonumber(ARGV[2]), tonumber(ARGV[3]), tonumber(ARGV[4])
local lease_ms = tonumber(ARGV[7])
local taken = groups_mode and gtaken or consumed
local now = now_ms()
reclaim_expired(consumed, gtaken, leases, redelivered, n, now)

-- scratch = NOT taken AND status_1 AND ... AND status_k. BITOP NOT only covers the bytes the taken
-- bitmap has, so pad it with 0xff up to the full size; bits past `units` are cleared by the AND
-- because no status bitmap ever sets them.
local nbytes = math.ceil(units / 8)
redis.call('BITOP', 'NOT', scratch, taken)
local have = redis.call('STRLEN', scratch)
if have < nbytes then
  redis.call('SETRANGE', scratch, have, string.rep('\255', nbytes - have))
end
redis.call('BITOP', 'AND', scratch, scratch, unpack(KEYS, 7))

local available = redis.call('BITCOUNT', scratch)
if available < count then
  redis.call('DEL', scratch)
  return {}
end

local picked = {}
if ARGV[5] == 'random' then
  -- Draw `count` distinct ranks among the available units (Floyd's algorithm), then walk the
  -- bitmap once to turn ranks into bit offsets. A Park-Miller generator is exact in doubles, so
  -- a seed gives the same pick on Redis and on fakeredis.
  local state = tonumber(ARGV[6]) % 2147483646 + 1
  local chosen, ranks = {}, {}
  for top = available - count, available - 1 do
    state = (state * 16807) % 2147483647
    local r = math.floor(state / 2147483647 * (top + 1))
    if chosen[r] then r = top end
    chosen[r] = true
    ranks[#ranks + 1] = r
  end
  table.sort(ranks)
  local offsets_in = {}   -- byte value -> offsets of its set bits, high bit (offset 0) first
  for value = 0, 255 do
    local list, rest = {}, value
    for offset = 0, 7 do
      local weight = 2 ^ (7 - offset)
      if rest >= weight then list[#list + 1] = offset; rest = rest - weight end
    end
    offsets_in[value] = list
  end
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
  -- Lowest units first: BITPOS skips to the first candidate, then the bitmap is read in 64-byte
  -- chunks and decoded here, rather than one BITPOS and SETBIT per unit.
  local byte = math.floor(redis.call('BITPOS', scratch, 1) / 8)
  while #picked < count do
    local chunk = redis.call('GETRANGE', scratch, byte, byte + 63)
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
      byte = math.floor(redis.call('BITPOS', scratch, 1, byte + 64) / 8)
    end
  end
end
redis.call('DEL', scratch)

local starts, lengths = runs_of(picked)
if groups_mode then
  for i = 1, #starts do starts[i], lengths[i] = starts[i] * n, lengths[i] * n end
end
mark_runs_taken(consumed, gtaken, starts, lengths, n)
if lease_ms > 0 then lease_rows(leases, rows_of_runs(starts, lengths), now + lease_ms) end
local reply = {}
for i = 1, #starts do reply[2 * i - 1], reply[2 * i] = starts[i], lengths[i] end
redis.call('SET', KEYS[5], table.concat(reply, ','), 'PX', ARGV[8])
return reply

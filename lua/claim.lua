--[[ claim: the first step of a put that names a leased delivery and takes more than one step (a sharded
put; a put on one slot in several slices): check that the delivery still holds its rows, and keep its
lease from running out while the bytes travel. unhold.lua gives the lease its own deadline back when the
put ends, whatever its outcome.

A sharded put writes its bytes to the data shards (other nodes) before mark.lua marks them ready, so
the fence (include/delivery.lua) is checked twice: here, before any byte is sent, and again by
mark.lua. Between the two, a clear moves the rows' generations, and the bytes go under fields no
reader asks for (see broker/data/sharded_store.py); but a lease that ran out and went to another worker would not:
both workers write the same fields. So this also holds the lease: its deadline moves to at least now
plus the put's own time bound, and the rows cannot be given back to anyone else while the put may
still be writing. (Only an explicit take of the rows, or reset_consumer, takes a lease over regardless;
mark.lua then refuses the put, but its bytes may already have replaced the taker's.)

KEYS[1]     td:{NAME}:meta
KEYS[2]     td:{NAME}:epoch
KEYS[3]     td:{NAME}:gen
KEYS[4]     td:{NAME}:tokens:CONSUMER    of the delivery's lease (td:{NAME}:meta without one)
KEYS[5]     td:{NAME}:leases:CONSUMER    (td:{NAME}:meta without a lease)
KEYS[6..5+S] td:{NAME}:reply:REQUEST_ID  the reply key of each of the put's S steps (its slices; the sharded
            put's one mark), in order: a step whose reply is kept landed already (include/once.lua)
ARGV[1]     the schema the client expects (see include/schema.lua)
ARGV[2]     the delivery's epoch
ARGV[3]     the delivery's generations of the rows, 4 bytes per row in run order
ARGV[4]     the token of the delivery's lease, or ""
ARGV[5]     how long to hold the lease, in ms: the put's time bound
ARGV[6]     S, the number of the put's steps named in KEYS (0: none, every row is checked)
ARGV[7..6+S] how many rows of the runs each step writes, in run order
ARGV[7+S..] the rows, as runs: start, length, ... (ascending, disjoint)

A put resumed (the same call run again after another process grew the dock, or the same put sent again
after it was cut short: its steps keep their request ids, see broker/data/slot_store.py) finds the steps that
landed by their kept replies: their rows are left out of the check and the hold (a step that acked its rows
ended their lease, so the check would refuse them), and the client skips those steps.

Returns {until, L, step, ..., row, deadline, row, deadline, ...}: the deadline the rows' lease is held to (ms
of server time, 0 without a lease), the L steps (numbered from 0) that landed already, and each row whose
deadline it moved with the one it had (for unhold.lua); or a FENCED error if the delivery no longer holds
the rows of the other steps. Repeating it is harmless (it then moves none).
]]
-- @include bits
-- @include schema
-- @include leases
-- @include delivery

local wrong_schema = schema_error(KEYS[1], ARGV[1])
if wrong_schema then return redis.error_reply(wrong_schema) end
local bad = wrong_type(2, 3, 'string') or wrong_type(4, 4, 'hash') or (ARGV[4] ~= '' and wrong_type(5, 5, 'zset'))
if bad then return redis.error_reply(bad) end
local steps = tonumber(ARGV[6])
local starts, lengths = runs_from(7 + steps)
local generations, landed = ARGV[3], {}
if steps > 0 then
  local all, left, kept, at = rows_of_runs(starts, lengths), {}, {}, 0
  for s = 1, steps do
    local count = tonumber(ARGV[6 + s])
    if redis.call('EXISTS', KEYS[5 + s]) == 1 then
      landed[#landed + 1] = s - 1
    else
      for i = at + 1, at + count do
        left[#left + 1] = all[i]; kept[#kept + 1] = string.sub(ARGV[3], 4 * i - 3, 4 * i)
      end
    end
    at = at + count
  end
  starts, lengths = runs_of(left)
  generations = table.concat(kept)
end
local fenced = #starts > 0 and fenced_off(KEYS[2], KEYS[3], KEYS[4], tonumber(ARGV[2]), generations, ARGV[4],
  starts, lengths)
if fenced then return redis.error_reply(fenced) end
local reply = {0, #landed}
for i = 1, #landed do reply[#reply + 1] = landed[i] end
if ARGV[4] ~= '' and #starts > 0 then
  local until_ms = now_ms() + tonumber(ARGV[5])
  local rows = rows_of_runs(starts, lengths)
  local deadlines = {}
  for i = 1, #rows do deadlines[i] = redis.call('ZSCORE', KEYS[5], rows[i]) end
  local held = {}
  reply[1] = until_ms
  for i = 1, #rows do
    if deadlines[i] and tonumber(deadlines[i]) < until_ms then
      held[#held + 1] = rows[i]
      reply[#reply + 1] = rows[i]; reply[#reply + 1] = deadlines[i]
    end
  end
  if #held > 0 then lease_rows(KEYS[5], KEYS[4], held, until_ms, ARGV[4]) end
end
return reply

--[[ leases: helpers for at-least-once delivery, pasted in by `-- @include leases` (after bits).

A leased row is marked consumed like any other, and also listed in the consumer's lease set
(sorted set: member = row, score = deadline in ms of server time). An ack removes it from the set;
a row whose deadline passes unacked is given back: its consumed bit (and, when no other row of the
group is still out, its group bit) is cleared, so the next sampling call offers it again.
]]

-- Milliseconds of server time: one clock for every client, whatever their own clocks say.
local function now_ms()
  local t = redis.call('TIME')
  return tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
end

-- Gives back every row of `leases` whose deadline is before `now`; counts them in `redelivered`.
local function reclaim_expired(consumed, gtaken, leases, redelivered, n, now)
  local expired = redis.call('ZRANGEBYSCORE', leases, '-inf', '(' .. now)
  if #expired == 0 then return 0 end
  local rows = {}
  for i = 1, #expired do rows[i] = tonumber(expired[i]) end
  give_back(consumed, gtaken, rows, n)
  redis.call('ZREMRANGEBYSCORE', leases, '-inf', '(' .. now)
  redis.call('INCRBY', redelivered, #rows)
  return #rows
end

-- Lists `rows` in `leases` with deadline `deadline` (ms).
local function lease_rows(leases, rows, deadline)
  for first = 1, #rows, 1000 do
    local args = {}
    for i = first, math.min(first + 999, #rows) do
      args[#args + 1] = deadline; args[#args + 1] = rows[i]
    end
    redis.call('ZADD', leases, unpack(args))
  end
end

--[[ leases: at-least-once delivery, pasted in by `-- @include leases`.

A leased row is marked consumed like any other, and also listed in two keys of its consumer:
td:{NAME}:leases:CONSUMER, a sorted set (member = row, score = deadline in ms of server time), and
td:{NAME}:tokens:CONSUMER, a hash (field = row, value = the token of the call that leased it).

The token is the delivery's identity, as a receipt handle is in SQS: an ack releases a row only while
the row is still leased under the token the ack names. A row whose lease expired and went to another
worker, or a row cleared and handed out again, carries another token, so a late or stale ack changes
nothing (the row is redone, which at-least-once allows) instead of releasing somebody else's lease.

An acked row's result is final: the row stays handed to the consumer (its bit in td:{NAME}:consumed:
CONSUMER stays set) until a clear or reset_consumer of the row, whatever becomes of the rest of its
delivery. A lease that expires (or that reclaim.lua's "all" ends) gives back only its own rows, those
still leased and unacked: never a row acked, nor one handed out for good (taken with no lease), which
both look the same here (handed out, no lease) and both are done.

Tokens of calls that handed out whole groups start with 'g'. Group sampling offers only groups with no
row handed out (td:{NAME}:gtaken:CONSUMER), so when such a lease gives back only part of a group (the
rest was acked: a stage acks the rows it finished with the fenced put of their results, and DP ranks
put their own share of a batch that split a group between them), the group is offered again all the
same, and marked in td:{NAME}:gremnant:CONSUMER: sampling then hands out only its rows not handed out
(include/bits.lua reoffer_groups, sample.lua). Nothing is stranded, and nothing acked is redone.
Rows handed out one by one ('r' tokens: explicit takes, row sampling) come back one by one, and a group
with another row still out stays out of group sampling, as before.

How the steps that touch one leased row interleave (each is one script, so they are ordered):
- ack (or a put that acks) before the lease is reclaimed: the row leaves the lease set and stays handed
  out; the reclaim gives back only the group's other rows. An ack after the deadline still counts while
  nothing gave the row back (the deadline says when the row may go, not that it went);
- ack after the reclaim: the row is no longer leased under that token, so the ack releases nothing (and a
  put naming the delivery is FENCED, include/delivery.lua): the row is redone, at least once;
- a clear or reset_consumer of some rows: they are handed out no more and their leases end, acked or
  not; the remnant mark of their group may outlive its purpose, which costs sampling a look at the
  group's row bits and nothing else (the row bits decide, the mark only says where to look). A whole
  clear, reset_consumer of every row and delete remove the mark with the consumer's other keys;
- a take of expired rows: it reclaims first, then takes them under its own token ('r'), which marks the
  group handed out: group sampling leaves it alone, as any group with a row taken explicitly, until no
  row of it is handed out (its acked rows are, until a clear or reset_consumer of them).
What sampling relies on: a group whose gtaken bit is clear while some of its rows are handed out is
marked in gremnant (only reoffer_groups makes such a group, and it marks it).
]]
-- @include bits

-- Milliseconds of server time: one clock for every client, whatever their own clocks say.
local function now_ms()
  local t = redis.call('TIME')
  return tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
end

-- The token holding the lease of each of `rows` (false where none). A hash of up to 128 entries is a
-- listpack, which HMGET searches from the start for every field: 128 rows of a 128-entry hash cost
-- 144 us that way, and 54 us read whole with HGETALL. So a small hash is read whole.
local function holders_of(tokens, rows)
  if redis.call('HLEN', tokens) > 2 * #rows then return hmget_in_chunks(tokens, rows) end
  local all, by_row = redis.call('HGETALL', tokens), {}
  for i = 1, #all, 2 do by_row[all[i]] = all[i + 1] end
  local out = {}
  for i = 1, #rows do out[i] = by_row[tostring(rows[i])] or false end
  return out
end

-- Removes the leases of `rows` (decimal strings or numbers), whoever holds them.
local function drop_leases(leases, tokens, rows)
  call_in_chunks('ZREM', leases, rows)
  call_in_chunks('HDEL', tokens, rows)
end

-- drop_leases of `rows` known to be leased (their holders were just read). When they are every lease of
-- the consumer, as when one worker's delivery is all that is out, both keys go at once: a listpack (a
-- zset or hash of up to 128 entries) removes member by member, each one a search from its start.
local function end_leases(leases, tokens, rows)
  if redis.call('HLEN', tokens) == #rows then
    redis.call('DEL', leases, tokens)
  else
    drop_leases(leases, tokens, rows)
  end
end

-- Lists `rows` in `leases` with deadline `deadline` (ms) under `token`, replacing any lease they had.
local function lease_rows(leases, tokens, rows, deadline, token)
  for first = 1, #rows, UNPACK_CHUNK do
    local scored, owned = {}, {}
    for i = first, math.min(first + UNPACK_CHUNK - 1, #rows) do
      scored[#scored + 1] = deadline; scored[#scored + 1] = rows[i]
      owned[#owned + 1] = rows[i]; owned[#owned + 1] = token
    end
    redis.call('ZADD', leases, unpack(scored))
    redis.call('HSET', tokens, unpack(owned))
  end
end

-- Gives back every row of `leases` whose deadline is before `now`, and no other, and counts them in
-- `redelivered`; the groups of those leased as whole groups (a 'g' token) are offered to group
-- sampling again even where some of their rows stay handed out (acked, see above), and marked in
-- `remnant` then. Returns how many rows, or nil and a CORRUPT error message if the lease set lists
-- something that is not a row.
local function reclaim_expired(consumed, gtaken, remnant, leases, tokens, redelivered, n, now)
  local expired = redis.call('ZRANGEBYSCORE', leases, '-inf', '(' .. now)
  if #expired == 0 then return 0 end
  for i = 1, #expired do
    if not string.match(expired[i], '^%d+$') then
      return nil, 'CORRUPT ' .. leases .. ' lists ' .. string.sub(expired[i], 1, 40) .. ', not a row'
    end
  end
  local holders = holders_of(tokens, expired)
  local back, grouped = {}, {}
  for i = 1, #expired do
    local row = tonumber(expired[i])
    back[#back + 1] = row
    if holders[i] and string.sub(holders[i], 1, 1) == 'g' then grouped[#grouped + 1] = row end
  end
  give_back(consumed, gtaken, back, n)
  reoffer_groups(consumed, gtaken, remnant, groups_of(grouped, n), n)
  drop_leases(leases, tokens, expired)
  redis.call('INCRBY', redelivered, #back)
  return #back
end

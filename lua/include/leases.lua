--[[ leases: at-least-once delivery, pasted in by `-- @include leases`.

A leased row is marked consumed like any other, and also listed in two keys of its consumer:
td:{NAME}:leases:CONSUMER, a sorted set (member = row, score = deadline in ms of server time), and
td:{NAME}:tokens:CONSUMER, a hash (field = row, value = the token of the call that leased it).

The token is the delivery's identity, as a receipt handle is in SQS: an ack releases a row only while
the row is still leased under the token the ack names. A row whose lease expired and went to another
worker, or a row cleared and handed out again, carries another token, so a late or stale ack changes
nothing (the row is redone, which at-least-once allows) instead of releasing somebody else's lease.

Tokens of calls that handed out whole groups start with 'g'. When such a lease expires the whole group
comes back, its already acked rows included: group sampling offers only groups with no row out, so
giving back half a group would strand it. Rows handed out one by one come back one by one.
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

-- Gives back every row of `leases` whose deadline is before `now` (the whole group where the lease
-- was a group's, see above), and counts the rows given back in `redelivered`. Returns how many, or
-- nil and a CORRUPT error message if the lease set lists something that is not a row.
local function reclaim_expired(consumed, gtaken, leases, tokens, redelivered, n, now)
  local expired = redis.call('ZRANGEBYSCORE', leases, '-inf', '(' .. now)
  if #expired == 0 then return 0 end
  for i = 1, #expired do
    if not string.match(expired[i], '^%d+$') then
      return nil, 'CORRUPT ' .. leases .. ' lists ' .. string.sub(expired[i], 1, 40) .. ', not a row'
    end
  end
  local holders = holders_of(tokens, expired)
  local back, is_back, whole = {}, {}, {}
  for i = 1, #expired do
    local row = tonumber(expired[i])
    back[#back + 1] = row; is_back[row] = true
    if holders[i] and string.sub(holders[i], 1, 1) == 'g' then whole[#whole + 1] = math.floor(row / n) end
  end
  if #whole > 0 then
    -- The other rows of those groups: give back those acked (consumed, no lease left); rows leased
    -- again since (by an explicit take) stay with their new holder.
    local others = {}
    local seen = {}
    for _, g in ipairs(whole) do
      if not seen[g] then
        seen[g] = true
        for r = g * n, (g + 1) * n - 1 do
          if not is_back[r] then others[#others + 1] = r end
        end
      end
    end
    if #others > 0 then
      local held = holders_of(tokens, others)
      local taken = get_bits(consumed, others)
      for i = 1, #others do
        if not held[i] and taken[i] == 1 then back[#back + 1] = others[i] end
      end
    end
  end
  give_back(consumed, gtaken, back, n)
  drop_leases(leases, tokens, expired)
  redis.call('INCRBY', redelivered, #back)
  return #back
end

--[[ release: give back rows a call handed out but could not deliver, and count the failed deliveries of
rows whose bytes could not be read.

Two reasons. A clear took some of a sampling call's rows away between handing them out and reading
their bytes (see fence.lua): the caller then samples again, so the call either returns rows whose bytes
were ready when it took them, or nothing: never rows of the next batch under this call's marks, never
rows twice. Or some rows' bytes could not be read (corrupt, or missing): the call raises, and its good
rows must not be lost with it (marked consumed, never delivered) nor, under a lease, come back with
the bad ones for ever. So every row is given back, and each unreadable row's failed deliveries are
counted in td:{NAME}:failures:CONSUMER; once a row failed as often as the dock's meta field
dead_letter_after says (3 when it has none; set when the dock was made) it is a dead letter instead:
it stays handed out (the consumer goes on without it; all_consumed counts it), its lease ends, and
td:{NAME}:dead:CONSUMER says why, for `broker dead` and the exporter to show. Handed out as whole
groups, a dead row takes the call's other rows of its group along: group sampling hands out a group's
rows together, and would otherwise hand out the good ones again without the dead one. Rows given back
of a call that handed out groups leave their groups offered to group sampling again, also a group
of which the call handed out only the rows left after others were acked (include/leases.lua).

Only rows no clear has touched since they were handed out are given back (a clear already reset the
others), and of those only rows still leased under this call's token when it leased them: a row a
later call took over stays with that call.

A release is done once per call: it leaves "released" as the call's kept reply, and a resend of it
(after a lost reply) finds that and gives back nothing more. Without that a resend could give back rows
another worker of the consumer was handed meanwhile, or count a failure twice.

KEYS[1]     td:{NAME}:meta
KEYS[2]     td:{NAME}:consumed:CONSUMER
KEYS[3]     td:{NAME}:gtaken:CONSUMER
KEYS[4]     td:{NAME}:leases:CONSUMER
KEYS[5]     td:{NAME}:tokens:CONSUMER
KEYS[6]     td:{NAME}:epoch
KEYS[7]     td:{NAME}:gen
KEYS[8]     td:{NAME}:reply:REQUEST_ID       the kept reply of the call
KEYS[9]     td:{NAME}:failures:CONSUMER
KEYS[10]    td:{NAME}:dead:CONSUMER
KEYS[11]    td:{NAME}:gremnant:CONSUMER (see include/leases.lua)
ARGV[1]     the schema the client expects (see include/schema.lua)
ARGV[2]     n_samples_per_prompt
ARGV[3]     the epoch the call's rows were handed out under
ARGV[4]     their generations
ARGV[5]     the call's lease token, or "" if it leased nothing
ARGV[6]     how long to keep the "released" mark, in ms
ARGV[7]     "groups" if the rows were handed out as whole groups, else "rows"
ARGV[8]     B, the number of unreadable rows; then B pairs: row, why it could not be read
then        the rows as runs: start, length, ... (ascending, disjoint)

Returns {rows given back, "row,row,..." dead letters made now, "n,n,..." failed deliveries so far of
each unreadable row, in ARGV order}.
]]
-- @include bits
-- @include schema
-- @include leases
-- @include generations

local wrong_schema = schema_error(KEYS[1], ARGV[1])
if wrong_schema then return redis.error_reply(wrong_schema) end
local bad = wrong_type(2, 3, 'string') or wrong_type(4, 4, 'zset') or wrong_type(5, 5, 'hash')
  or wrong_type(6, 8, 'string') or wrong_type(9, 10, 'hash') or wrong_type(11, 11, 'string')
if bad then return redis.error_reply(bad) end

if redis.call('GET', KEYS[8]) == 'released' then return {0, '', ''} end
redis.call('SET', KEYS[8], 'released', 'PX', ARGV[6])
local n, nbad = tonumber(ARGV[2]), tonumber(ARGV[8])
local limit = tonumber(redis.call('HGET', KEYS[1], 'dead_letter_after') or '3') or 3
local starts, lengths = runs_from(9 + 2 * nbad)
local rows = unchanged_rows(KEYS[6], KEYS[7], tonumber(ARGV[3]), ARGV[4], starts, lengths)
local token = ARGV[5]
if token ~= '' and #rows > 0 then
  local holders = holders_of(KEYS[5], rows)
  local mine = {}
  for i = 1, #rows do
    if holders[i] == token then mine[#mine + 1] = rows[i] end
  end
  rows = mine
end
local ours = {}
for _, r in ipairs(rows) do ours[r] = true end

-- Unreadable rows still ours: count the failure; at the limit, the row (its group, in group mode) dies.
local dead, counts, why = {}, {}, {}
for i = 0, nbad - 1 do
  local row, reason = tonumber(ARGV[9 + 2 * i]), ARGV[10 + 2 * i]
  local count = 0
  if ours[row] then
    count = redis.call('HINCRBY', KEYS[9], row, 1)
    if count >= limit then
      local members = ARGV[7] == 'groups' and rows_of_groups({math.floor(row / n)}, n) or {row}
      for _, r in ipairs(members) do
        if ours[r] and not why[r] then
          dead[#dead + 1] = r
          why[r] = r == row and reason or ('row ' .. row .. ' of its group is a dead letter')
        end
      end
      why[row] = reason .. ' (' .. count .. ' failed deliveries)'
    end
  end
  counts[#counts + 1] = count
end
local back = {}
for _, r in ipairs(rows) do
  if not why[r] then back[#back + 1] = r end
end
if token ~= '' then drop_leases(KEYS[4], KEYS[5], rows) end
give_back(KEYS[2], KEYS[3], back, n)
if ARGV[7] == 'groups' then reoffer_groups(KEYS[2], KEYS[3], KEYS[11], groups_of(back, n), n) end
for _, r in ipairs(dead) do
  redis.call('HSET', KEYS[10], r, why[r])
  redis.call('HDEL', KEYS[9], r)
end
return {#back, table.concat(dead, ','), table.concat(counts, ',')}

--[[ tq_rows: give rows to TransferQueue samples of one partition (the adapter broker.transfer_queue).

TransferQueue addresses a sample by a global index, unique across partitions while the sample lives, and
optionally by a user key inside its partition. Here a global index is a row of the system's dock. New
samples get released rows first, oldest release first (as TransferQueue reuses its indexes), then rows
never used; a key that has a row keeps it (a later put of new fields for an existing key adds columns to
that row). The partition is created by its first rows.

TransferQueue lists partitions in the order they were made, and a partition's keys in the order they were
first given rows (kv_list; verl's replay buffers take batches in that order), not by index: each creation
takes the next number of KEYS[10] as its place, and each new key too, in the order asked. A system cut into
sub-systems (broker.partitions > 1, systems.py) orders partitions over all of them: the caller then passes
the place a new partition takes (ARGV[5], a number of the system's own counter), used only if this call
makes the partition; or, when it has seen the partition already, '-': then a call that would make it (another
process cleared it since) makes nothing and answers {-1}, and the caller takes a place and calls again. So the
system's counter is asked only by calls that may make a partition, not by every put. A cleared key
loses its place (tq_release.lua); put again, it comes last, as in TransferQueue.

A reused row was cleared before it was released (tq_release.lua runs after the dock's clear), but a put
that looked its key up before the clear may still have landed on it since, and clear_partition releases
rows given to the partition after it cleared the others: a reused row's ready and consumed bits are
cleared here, so a new sample never looks produced, or consumed, before it is, and its generation is
bumped (include/generations.lua), so a write or a read fenced by what the row's old sample had (a put of
the old key that looked it up between the clear and the release) is refused instead of landing on the new
sample: the rows come back with the dock's epoch and their generations, which the adapter's writes into
them and reads of them name (lua/include/delivery.lua).

KEYS[1]     td:{NAME}:tq:next       rows below it have been used
KEYS[2]     td:{NAME}:tq:free       released rows, a list, oldest first
KEYS[3]     td:{NAME}:tq:partitions partition -> when it was created (ms), a hash
KEYS[4]     td:{NAME}:tq:rows:P     the partition's rows, a bitmap
KEYS[5]     td:{NAME}:tq:keys:P     key -> row, a hash
KEYS[6]     td:{NAME}:tq:rkeys:P    row -> key, a hash
KEYS[7]     td:{NAME}:meta          the dock's schema, checked: the status keys below are its columns'
KEYS[8]     td:{NAME}:epoch
KEYS[9]     td:{NAME}:gen           the rows' generations
KEYS[10]    td:{NAME}:tq:seq        a counter: places in creation order, of partitions and of keys
KEYS[11]    td:{NAME}:tq:order:P    key -> its place in the order keys were given rows, a sorted set
KEYS[12..]  td:{NAME}:ready:COLUMN and td:{NAME}:consumed:CONSUMER, for every column and consumer
ARGV[1]     the partition P
ARGV[2]     the dock's capacity (rows)
ARGV[3]     how many rows to give new anonymous samples; 0 when keys follow
ARGV[4]     the schema the client expects (see include/schema.lua): a client that missed a column
            another process added would leave that column's bits on a reused row
ARGV[5]     the place the partition takes if this call makes it; '': the next number of KEYS[10]; '-': none,
            the partition must exist (else the reply is {-1} and nothing is done)
ARGV[6..]   keys, each getting its row (a new one if it has none)

Returns {epoch, generations, fresh, row, ...}: the rows, one per key or per new sample, in the order asked;
the dock's epoch and the rows' generations (4 bytes per row, for the rows ascending, each once); and per
key a character, "1" if this call gave it its row, "0" if it had one (all "1" for new samples). Or an
error naming the partition when the dock has too few free rows (nothing is given then).

last        how long to keep the reply, in ms; and td:{NAME}:reply:REQUEST_ID as the last key
            (include/once.lua): a resend after a lost reply gets the same rows, not new ones
]]
-- @include bits
-- @include schema
-- @include generations
-- @include once

local reply_key, reply_ttl = once_args()
local kept = kept_reply(reply_key)
if kept then return kept end

local wrong_schema = schema_error(KEYS[7], ARGV[4])
if wrong_schema then return redis.error_reply(wrong_schema) end
if ARGV[5] == '-' and redis.call('HEXISTS', KEYS[3], ARGV[1]) == 0 then
  return keep_reply(reply_key, reply_ttl, {-1})
end

local partition, capacity, anonymous = ARGV[1], tonumber(ARGV[2]), tonumber(ARGV[3])
local rows, wanted, new_keys = {}, 0, {}
if anonymous > 0 then
  wanted = anonymous
else
  local asked = {}
  for i = 6, #ARGV do asked[#asked + 1] = ARGV[i] end
  local known = hmget_in_chunks(KEYS[5], asked)  -- one HMGET per thousand keys, not one HGET per key
  for i = 6, #ARGV do
    local row = known[i - 5]
    if row then
      rows[i - 5] = tonumber(row)
    elseif not new_keys[ARGV[i]] then  -- a new key asked twice in one call gets one row, for both, below
      wanted = wanted + 1
      new_keys[ARGV[i]] = -1
    end
  end
end

local free = redis.call('LLEN', KEYS[2])
local next_row = tonumber(redis.call('GET', KEYS[1]) or '0')
if wanted > free + (capacity - next_row) then
  return redis.error_reply('ERR partition ' .. partition .. ': ' .. wanted .. ' new samples, but the dock has '
    .. (free + capacity - next_row) .. ' of its ' .. capacity .. ' rows free; clear consumed samples, or init with a '
    .. 'larger broker.capacity')
end

local given = {}
local reused = math.min(wanted, free)
if reused > 0 then
  local popped = redis.call('LPOP', KEYS[2], reused)
  if type(popped) ~= 'table' then popped = {popped} end  -- Redis 6.2 returns a list for a count too
  for i = 1, #popped do given[#given + 1] = tonumber(popped[i]) end
  local starts, lengths = runs_of(given)  -- sorted into runs once, for every status key
  for k = 12, #KEYS do set_runs(KEYS[k], starts, lengths, 0) end
  bump_generations(KEYS[9], given)
end
for r = next_row, next_row + (wanted - reused) - 1 do given[#given + 1] = r end
if wanted > reused then redis.call('SET', KEYS[1], next_row + wanted - reused) end

if redis.call('HEXISTS', KEYS[3], partition) == 0 then
  local place = ARGV[5]
  if place == '' then place = redis.call('INCR', KEYS[10]) end
  redis.call('HSET', KEYS[3], partition, place)
end
local g = 0
local fresh = {}
if anonymous > 0 then
  rows = given
  fresh[1] = string.rep('1', #given)
else
  local key_rows, row_keys = {}, {}  -- field, value pairs of the two hashes, each set in chunks below
  for i = 6, #ARGV do
    if not rows[i - 5] then
      local key = ARGV[i]
      if new_keys[key] == -1 then
        g = g + 1
        new_keys[key] = given[g]
        local row = int_text(given[g])
        key_rows[#key_rows + 1] = key; key_rows[#key_rows + 1] = row
        row_keys[#row_keys + 1] = row; row_keys[#row_keys + 1] = key
      end
      rows[i - 5] = new_keys[key]
    end
    fresh[i - 5] = new_keys[ARGV[i]] and '1' or '0'
  end
  if #key_rows > 0 then  -- chunks of an even count: pairs stay whole
    call_in_chunks('HSET', KEYS[5], key_rows)
    call_in_chunks('HSET', KEYS[6], row_keys)
    local last = redis.call('INCRBY', KEYS[10], g)  -- the g new keys take the places up to it, in order asked
    local places = {}
    for i = 1, #key_rows, 2 do
      places[#places + 1] = last - g + (i + 1) / 2; places[#places + 1] = key_rows[i]
    end
    call_in_chunks('ZADD', KEYS[11], places)
  end
end
set_bits(KEYS[4], given, 1)
local run_starts, run_lengths = runs_of(rows)
local reply = {epoch_of(KEYS[8]), generations_of_runs(KEYS[9], run_starts, run_lengths), table.concat(fresh)}
for i = 1, #rows do reply[i + 3] = rows[i] end
return keep_reply(reply_key, reply_ttl, reply)

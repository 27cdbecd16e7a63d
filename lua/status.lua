--[[ status: one dock's counts, read atomically (dock.status(), broker status, the exporter).

Reads only. The client queues one call per dock in one plain pipeline, so reading any number of docks
is one round trip, and each dock's counts are one consistent snapshot (a script runs alone) with no
MULTI around all of them: such a MULTI held the server for the whole batch (11 ms for 1,000 docks)
and cannot span the slots of a cluster. Keys of the wrong type are reported, not crashed on; counts
that no broker could have written (more bits than rows) are for the client to judge.

KEYS[1]     td:{NAME}:meta
KEYS[2..]   for each column: td:{NAME}:ready:COLUMN, td:{NAME}:gready:COLUMN; then for each consumer:
            td:{NAME}:consumed:CONSUMER, td:{NAME}:gtaken:CONSUMER; then the generation bitmaps
            td:{NAME}:finished, td:{NAME}:gfinished, td:{NAME}:gage:0 .. gage:A-1 and
            td:{NAME}:gwait:1 .. gwait:A-1 (the bitmaps);
            then for each consumer: td:{NAME}:leases:CONSUMER, td:{NAME}:redelivered:CONSUMER,
            td:{NAME}:dead:CONSUMER; then
            td:{NAME}:version, td:{NAME}:discarded, td:{NAME}:gversions, and the data hash of the
            first response column (td:{NAME}:data:COLUMN; td:{NAME}:meta when there is none)
ARGV[1]     the schema the client expects (see include/schema.lua)
ARGV[2]     the number of bitmaps: 2 x columns + 2 x consumers + 2 + A + (A - 1, or 0 when A = 0)
ARGV[3]     max_staleness, or "" without a staleness bound

Returns, flat: bits set and bytes of each bitmap, in KEYS order; then for each consumer the rows
leased, the redelivered counter as stored (false if unset) and its dead letters; then the version as stored (a
LOST error if it was set and is gone, see include/current_version.lua), the
discarded counts as one "field=count,..." string, the stale groups (older than version -
max_staleness; 0 without a bound), the rows holding a response or its placeholder, and the byte quota
and the bytes counted against it as stored ("" for each without a quota, see include/quota.lua).
]]
-- @include bits
-- @include schema
-- @include current_version

local wrong_schema = schema_error(KEYS[1], ARGV[1])
if wrong_schema then return redis.error_reply(wrong_schema) end

-- redis.pcall, not redis.call: a key of another type must name itself in the error, not fail the
-- script with Redis's bare WRONGTYPE.
local function read(command, key, expected)
  local reply = redis.pcall(command, key)
  if type(reply) == 'table' and reply.err then
    return nil, 'CORRUPT ' .. key .. ' is not a ' .. expected .. ' (' .. reply.err .. ')'
  end
  return reply, nil
end

local out = {}
local bitmaps = tonumber(ARGV[2])
for i = 2, bitmaps + 1 do
  local bits, err = read('BITCOUNT', KEYS[i], 'bitmap')
  if err then return redis.error_reply(err) end
  out[#out + 1] = bits
  out[#out + 1] = redis.call('STRLEN', KEYS[i])
end
for i = bitmaps + 2, #KEYS - 4, 3 do
  local leased, err = read('ZCARD', KEYS[i], 'lease set')
  if err then return redis.error_reply(err) end
  local counter, dead
  counter, err = read('GET', KEYS[i + 1], 'counter')
  if err then return redis.error_reply(err) end
  dead, err = read('HLEN', KEYS[i + 2], 'hash')
  if err then return redis.error_reply(err) end
  out[#out + 1] = leased
  out[#out + 1] = counter
  out[#out + 1] = dead
end
local version, discarded, gversions, responses = KEYS[#KEYS - 3], KEYS[#KEYS - 2], KEYS[#KEYS - 1], KEYS[#KEYS]
local err
local current
current, err = read('GET', version, 'counter')
if err then return redis.error_reply(err) end
if not current then   -- never set (0), or set and lost: reported, not shown as 0
  local _, lost = current_version(KEYS[1], version)
  if lost then return redis.error_reply(lost) end
end
out[#out + 1] = current
local counts
counts, err = read('HGETALL', discarded, 'hash')
if err then return redis.error_reply(err) end
local parts = {}
for i = 1, #counts, 2 do parts[#parts + 1] = counts[i] .. '=' .. counts[i + 1] end
out[#out + 1] = table.concat(parts, ',')
local stale = 0
if ARGV[3] ~= '' and redis.call('TYPE', gversions)['ok'] == 'zset' then
  local bound = (tonumber(current) or 0) - tonumber(ARGV[3])
  stale = redis.call('ZCOUNT', gversions, '-inf', '(' .. int_text(bound))
end
out[#out + 1] = stale
local held = 0
if responses ~= KEYS[1] then
  held, err = read('HLEN', responses, 'hash')
  if err then return redis.error_reply(err) end
end
out[#out + 1] = held
local quota = redis.call('HMGET', KEYS[1], 'quota_bytes', 'stored_bytes')
out[#out + 1] = quota[1] or ''
out[#out + 1] = quota[2] or ''
return out

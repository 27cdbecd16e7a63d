--[[ status: one dock's counts, read atomically (dock.status(), broker status, the exporter).

Reads only. The client queues one call per dock in one plain pipeline, so reading any number of docks
is one round trip, and each dock's counts are one consistent snapshot (a script runs alone) with no
MULTI around all of them: such a MULTI held the server for the whole batch (11 ms for 1,000 docks)
and cannot span the slots of a cluster. Keys of the wrong type are reported, not crashed on; counts
that no broker could have written (more bits than rows) are for the client to judge.

KEYS[1]     td:{NAME}:meta
KEYS[2..]   for each column: td:{NAME}:ready:COLUMN, td:{NAME}:gready:COLUMN; then for each consumer:
            td:{NAME}:consumed:CONSUMER, td:{NAME}:gtaken:CONSUMER (the bitmaps); then for each
            consumer: td:{NAME}:leases:CONSUMER, td:{NAME}:redelivered:CONSUMER
ARGV[1]     the schema the client expects (see include/schema.lua)
ARGV[2]     the number of bitmaps: 2 x columns + 2 x consumers

Returns, flat: bits set and bytes of each bitmap, in KEYS order; then for each consumer the rows
leased and the redelivered counter as stored (false if unset).
]]
-- @include schema

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
for i = bitmaps + 2, #KEYS, 2 do
  local leased, err = read('ZCARD', KEYS[i], 'lease set')
  if err then return redis.error_reply(err) end
  local counter
  counter, err = read('GET', KEYS[i + 1], 'counter')
  if err then return redis.error_reply(err) end
  out[#out + 1] = leased
  out[#out + 1] = counter
end
return out

--[[ reserve: claim free groups for new prompts, lowest first, so that many writers never pick the same.

Under partial rollout rows never move (MindSpeed re-sorts its dock so that the groups kept are at the
front and the next batch goes at fixed indexes; here the free groups are wherever the trained ones
were). A group is free when it is not claimed and not fully written in the prompt column; it stays
claimed until it is forgotten (trained and cleared, dropped, or a whole clear).

KEYS[1]     td:{NAME}:meta
KEYS[2]     td:{NAME}:claimed
KEYS[3]     td:{NAME}:gready:COLUMN     of the prompt column
KEYS[4]     td:{NAME}:scratch
KEYS[5]     td:{NAME}:epoch
KEYS[6]     td:{NAME}:gen
ARGV[1]     the schema the client expects (see include/schema.lua)
ARGV[2]     how many groups
ARGV[3]     prompts_num
ARGV[4]     n_samples_per_prompt (rows per group)

Returns {} (claiming nothing) if fewer are free, else {epoch, generations, groups claimed ascending...}:
the dock's epoch and the generations of the groups' rows (4 bytes per row, include/generations.lua), by
which unreserve.lua gives the groups back only if nothing forgot them since (see there).

last        how long to keep the reply, in ms; and td:{NAME}:reply:REQUEST_ID as the last key
            (include/once.lua): a resend after a lost reply gets the same groups, and claims no more
]]
-- @include bits
-- @include schema
-- @include generations
-- @include once

local reply_key, reply_ttl = once_args()
local kept = kept_reply(reply_key)
if kept then return kept end

local wrong_schema = schema_error(KEYS[1], ARGV[1])
if wrong_schema then return redis.error_reply(wrong_schema) end
local bad = wrong_type(2, 6, 'string')
if bad then return redis.error_reply(bad) end
local count, units = tonumber(ARGV[2]), tonumber(ARGV[3])
local nbytes = math.ceil(units / 8)
local too_long = longer_than(nbytes, KEYS[2], KEYS[3])
if too_long then return redis.error_reply(too_long) end
-- scratch = NOT (claimed OR written), padded to the dock's groups; bits past them are cut below.
redis.call('BITOP', 'OR', KEYS[4], KEYS[2], KEYS[3])
redis.call('BITOP', 'NOT', KEYS[4], KEYS[4])
local have = redis.call('STRLEN', KEYS[4])
if have < nbytes then redis.call('SETRANGE', KEYS[4], have, string.rep('\255', nbytes - have)) end
local free = {}
for _, g in ipairs(offsets_of(KEYS[4])) do
  if g >= units or #free == count then break end
  free[#free + 1] = g
end
redis.call('DEL', KEYS[4])
if #free < count then return {} end
set_bits(KEYS[2], free, 1)
local n = tonumber(ARGV[4])
local starts, lengths = {}, {}
for i, g in ipairs(free) do starts[i] = g * n; lengths[i] = n end
return keep_reply(reply_key, reply_ttl, {epoch_of(KEYS[5]), generations_of_runs(KEYS[6], starts, lengths), unpack(free)})

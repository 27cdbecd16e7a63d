--[[ unreserve: give back groups a reserve claimed, unless something forgot them since.

reserve_groups calls it when, with wait_replicas, the replicas did not acknowledge the claim in time: a
failover could then undo the claim, and with it whatever the primary applied just before (a drop that
freed the groups), while the caller, holding the groups, would put its prompts into a group that holds
another prompt still, or that another writer claims on the new primary. Given back at once, the groups
are never used on the strength of a claim that may not survive. Here or on the promoted replica alike,
the groups end unclaimed: either this ran (and replicates after the claim), or neither did.

The groups are given back only if the dock's epoch and their rows' generations are still those the
reserve read: a forget of a group (a clear, a drop) bumps them and clears its claim, and the group may
since be claimed by another writer, whose claim must stay.

KEYS[1]     td:{NAME}:meta
KEYS[2]     td:{NAME}:claimed
KEYS[3]     td:{NAME}:epoch
KEYS[4]     td:{NAME}:gen
ARGV[1]     the schema the client expects (see include/schema.lua)
ARGV[2]     n_samples_per_prompt (rows per group)
ARGV[3]     the epoch reserve.lua returned
ARGV[4]     the generations reserve.lua returned (4 bytes per row, the groups' rows in order)
ARGV[5..]   the groups, ascending, as reserve.lua returned them

Returns how many groups were given back.

last        how long to keep the reply, in ms; and td:{NAME}:reply:REQUEST_ID as the last key
            (include/once.lua): a resend after a lost reply gives nothing back twice
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
local bad = wrong_type(2, 4, 'string')
if bad then return redis.error_reply(bad) end
local n = tonumber(ARGV[2])
local starts, lengths = {}, {}
for i = 5, #ARGV do starts[#starts + 1] = tonumber(ARGV[i]) * n; lengths[#lengths + 1] = n end
local kept_rows = {}
for _, r in ipairs(unchanged_rows(KEYS[3], KEYS[4], tonumber(ARGV[3]), ARGV[4], starts, lengths)) do
  kept_rows[r] = true
end
local back = {}
for i = 5, #ARGV do
  local g, whole = tonumber(ARGV[i]), true
  for r = g * n, g * n + n - 1 do whole = whole and kept_rows[r] == true end
  if whole then back[#back + 1] = g end
end
if #back > 0 then set_bits(KEYS[2], back, 0) end
return keep_reply(reply_key, reply_ttl, #back)

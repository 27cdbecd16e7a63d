--[[ tq_lookup: the rows of TransferQueue keys, with what a read of them checks (the adapter
broker.transfer_queue: kv_batch_get).

Looking a key up and reading its row's bytes are two round trips, and a kv_clear can end the key between
them and give its row to another key, whose bytes the read would then return as the first key's. So the
rows come with the dock's epoch and their generations, read in the same step as the key -> row hash: the
read of the bytes checks them again after its HMGETs (lua/fence.lua, include/generations.lua), and an
unchanged value means no clear took the row in between, so its bytes are still the key's. The adapter's
clears bump a row's generation (the dock's clear, and tq_rows.lua when it gives a released row to a new
sample). Reads nothing else and writes nothing.

KEYS[1]     td:{NAME}:tq:keys:P     key -> row, a hash
KEYS[2]     td:{NAME}:epoch
KEYS[3]     td:{NAME}:gen
ARGV[1..]   keys

Returns {epoch, generations, row, ...}: a row per key in the order given, -1 for a key the partition does not
hold; generations are 4 bytes per row found, for the rows in ascending order, each once (the runs a read's
fence takes).
]]
-- @include bits
-- @include generations

local bad = wrong_type(1, 1, 'hash') or wrong_type(2, 3, 'string')
if bad then return redis.error_reply(bad) end
local asked = {}
for i = 1, #ARGV do asked[i] = ARGV[i] end
local known = hmget_in_chunks(KEYS[1], asked)  -- one HMGET per thousand keys
local reply, found = {0, ''}, {}
for i = 1, #ARGV do
  local row = known[i] and tonumber(known[i]) or -1
  reply[i + 2] = row
  if row >= 0 then found[#found + 1] = row end
end
local starts, lengths = runs_of(found)
reply[1] = epoch_of(KEYS[2])
reply[2] = generations_of_runs(KEYS[3], starts, lengths)
return reply

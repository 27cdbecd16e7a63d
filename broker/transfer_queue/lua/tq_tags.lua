--[[ tq_tags: store the tags of TransferQueue samples, fenced against clears and compared against other
writers (the adapter broker.transfer_queue: kv_batch_put's tags, set_custom_meta).

A sample's tags are one msgpack map per row, in the partition's tags hash. A put merges its tags over the
key's earlier ones on the client (msgpack is not for a script to read here: fakeredis has no cmsgpack), so
the write checks two things before it writes anything:
- the rows are still the ones the keys had: no clear took them since they were looked up (the dock's epoch
  and their generations unchanged, include/delivery.lua); else the key ended, its row may be another
  sample's now, and the caller looks its keys up again (FENCED);
- with comparing on, each row's tags are still what the client merged over; else another put of the same
  key wrote in between, and the client reads and merges again (the reply 0).

KEYS[1]     td:{NAME}:tq:tags:P     row -> the sample's tags (msgpack), a hash
KEYS[2]     td:{NAME}:epoch
KEYS[3]     td:{NAME}:gen           the rows' generations
ARGV[1]     the epoch the rows were looked up under; "" for a write fenced by nothing
ARGV[2]     their generations (4 bytes per row, for the runs' rows in order)
ARGV[3]     1: compare each row's tags with what the client merged over; 0: do not
ARGV[4]     how many runs follow, n
ARGV[5 .. 4+2n]    the rows as runs: start, length (ascending, disjoint)
ARGV[5+2n ..]      per row: the row, the tags the client merged over ("" for none), the tags to store

Returns 1 (every row written), or 0 (a row's tags changed since the client read them; nothing written); or a
FENCED error naming the rows a clear took (nothing written).
]]
-- @include bits
-- @include delivery

local bad = wrong_type(1, 1, 'hash') or wrong_type(2, 3, 'string')
if bad then return redis.error_reply(bad) end
local nruns = tonumber(ARGV[4])
local starts, lengths = {}, {}
for i = 1, nruns do
  starts[i] = tonumber(ARGV[3 + 2 * i]); lengths[i] = tonumber(ARGV[4 + 2 * i])
end
if ARGV[1] ~= '' then
  local fenced = fenced_off(KEYS[2], KEYS[3], '', tonumber(ARGV[1]), ARGV[2], '', starts, lengths)
  if fenced then return redis.error_reply(fenced) end
end
local first = 5 + 2 * nruns
if ARGV[3] == '1' then
  local fields = {}
  for i = first, #ARGV, 3 do fields[#fields + 1] = ARGV[i] end
  local now = hmget_in_chunks(KEYS[1], fields)
  for j = 1, #fields do
    if (now[j] or '') ~= ARGV[first + 3 * (j - 1) + 1] then return 0 end
  end
end
local pairs_ = {}
for i = first, #ARGV, 3 do
  pairs_[#pairs_ + 1] = ARGV[i]; pairs_[#pairs_ + 1] = ARGV[i + 2]
end
if #pairs_ > 0 then call_in_chunks('HSET', KEYS[1], pairs_) end
return 1

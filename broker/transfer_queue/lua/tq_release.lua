--[[ tq_release: end TransferQueue samples of one partition and offer their rows to new samples
(the adapter broker.transfer_queue: kv_clear, clear_samples, clear_partition).

The adapter clears the rows in the dock first (their bytes, ready and consumed bits, leases), then runs
this: the rows leave the partition, their keys and tags are forgotten, and the rows join the free list.
Only rows still in the partition are released, so two clears of the same sample at once free its row
once (a row on the free list twice would be given to two samples).

KEYS[1]     td:{NAME}:tq:free       released rows, a list, oldest first
KEYS[2]     td:{NAME}:tq:rows:P     the partition's rows, a bitmap
KEYS[3]     td:{NAME}:tq:keys:P     key -> row, a hash
KEYS[4]     td:{NAME}:tq:rkeys:P    row -> key, a hash
KEYS[5]     td:{NAME}:tq:tags:P     row -> the sample's tags (msgpack), a hash
KEYS[6]     td:{NAME}:tq:partitions partition -> when it was created, a hash
KEYS[7]     td:{NAME}:tq:fields:P   field -> its schema in P, a hash (deleted with the partition)
KEYS[8]     td:{NAME}:tq:order:P    key -> its place in kv_list's order, a sorted set
ARGV[1]     the partition P
ARGV[2]     1: release every row of the partition and forget the partition (clear_partition); 0: keep it
ARGV[3..]   rows, decimal (with ARGV[2] = 1: none; the partition's bitmap says which)

Returns the rows released (those that were in the partition), in the order given.

last        how long to keep the reply, in ms; and td:{NAME}:reply:REQUEST_ID as the last key
            (include/once.lua): a resend after a lost reply must not release a row that a new sample
            of the partition has been given since
]]
-- @include bits
-- @include once

local reply_key, reply_ttl = once_args()
local kept = kept_reply(reply_key)
if kept then return kept end

local rows = {}
if ARGV[2] == '1' then
  -- Every row of the partition as it is now, including rows given to it after the caller read it.
  local bitmap = redis.call('GET', KEYS[2]) or ''
  for byte = 1, #bitmap do
    local b = string.byte(bitmap, byte)
    if b ~= 0 then
      for bit = 0, 7 do
        if math.floor(b / 2 ^ (7 - bit)) % 2 == 1 then rows[#rows + 1] = (byte - 1) * 8 + bit end
      end
    end
  end
else
  for i = 3, #ARGV do rows[#rows + 1] = tonumber(ARGV[i]) end
end

local released = {}
for _, row in ipairs(rows) do
  local field = int_text(row)
  if redis.call('GETBIT', KEYS[2], row) == 1 then
    redis.call('SETBIT', KEYS[2], row, 0)
    local key = redis.call('HGET', KEYS[4], field)
    if key then
      redis.call('HDEL', KEYS[3], key)
      redis.call('HDEL', KEYS[4], field)
      redis.call('ZREM', KEYS[8], key)
    end
    redis.call('HDEL', KEYS[5], field)
    redis.call('RPUSH', KEYS[1], field)
    released[#released + 1] = row
  end
end
if ARGV[2] == '1' then
  redis.call('HDEL', KEYS[6], ARGV[1])
  redis.call('DEL', KEYS[2], KEYS[3], KEYS[4], KEYS[5], KEYS[7], KEYS[8])
end
return keep_reply(reply_key, reply_ttl, released)

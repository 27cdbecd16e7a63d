--[[ gate: the first step of a put on one slot: decide whether its bytes may land.

A put on one slot is one MULTI/EXEC: this script, the HSETs of the rows' bytes, then put.lua. Redis
has no conditional transaction: every command of a MULTI runs. So when the put must not land, this
script makes its HSETs fail instead of letting them overwrite anything: it sets each data hash the put
writes aside (RENAME to td:{NAME}:aside:COLUMN, O(1) whatever its size) and leaves a string in its
place, on which the HSETs fail with WRONGTYPE and write nothing. put.lua then puts the hashes back and
answers with the verdict this script left in td:{NAME}:gate. Nothing of this is ever seen outside the
MULTI: the keys are back as they were when the EXEC ends. A put lands, whole, unless:
- the dock is gone or changed (NODOCK, SCHEMA), or a data hash holds something else (CORRUPT);
- it is a resend of a put that already landed (its reply is kept, include/once.lua): rewriting the
  bytes could overwrite what another worker wrote since (a rollout's put gives unfinished rows back at
  once); put.lua answers with the kept reply;
- it names a delivery that is no longer current (include/delivery.lua): FENCED.

KEYS[1]         td:{NAME}:meta
KEYS[2]         td:{NAME}:gate                the verdict for put.lua (absent: the bytes land)
KEYS[3]         td:{NAME}:epoch
KEYS[4]         td:{NAME}:gen
KEYS[5]         td:{NAME}:tokens:CONSUMER     of the delivery's lease (td:{NAME}:meta without one)
KEYS[2i+4]      td:{NAME}:data:COLUMN_i       data hash of the i-th column written
KEYS[2i+5]      td:{NAME}:aside:COLUMN_i      where it is set aside if the put must not land
last            td:{NAME}:reply:REQUEST_ID    the put's request id (include/once.lua; put.lua keeps the reply)
ARGV[1]         the schema the client expects (see include/schema.lua)
ARGV[2]         "1" if the put names a delivery (then ARGV[3..5] matter), else "0"
ARGV[3]         the delivery's epoch
ARGV[4]         the delivery's generations of the rows written, 4 bytes per row in run order
ARGV[5]         the token of the delivery's lease, or "" without one
ARGV[6..]       rows written, as runs: start, length, ... (ascending, disjoint)
last            how long put.lua keeps the reply, in ms (unused here)

Returns 1 if the bytes may land, 0 if they were fenced off (put.lua says why).
]]
-- @include bits
-- @include schema
-- @include delivery
-- @include once

local PLACEHOLDER = 'a put refused by gate.lua is passing through'
local reply_key = once_args()
-- A put whose put.lua never ran (NOSCRIPT: only possible if the server lost put.lua but not this
-- script) left its hashes aside; put them back before anything else.
redis.call('DEL', KEYS[2])
for k = 6, #KEYS, 2 do
  if redis.call('TYPE', KEYS[k])['ok'] == 'string' and redis.call('GET', KEYS[k]) == PLACEHOLDER then
    redis.call('DEL', KEYS[k])
    if redis.call('EXISTS', KEYS[k + 1]) == 1 then redis.call('RENAME', KEYS[k + 1], KEYS[k]) end
  end
end
local verdict = schema_error(KEYS[1], ARGV[1])
if not verdict then
  verdict = wrong_type(2, 4, 'string') or wrong_type(5, 5, 'hash')
  for k = 6, #KEYS, 2 do verdict = verdict or wrong_type(k, k, 'hash') end
end
if not verdict and redis.call('EXISTS', reply_key) == 1 then verdict = '=replay' end
if not verdict and ARGV[2] == '1' then
  verdict = fenced_off(KEYS[3], KEYS[4], KEYS[5], tonumber(ARGV[3]), ARGV[4], ARGV[5], runs_from(6))
end
if not verdict then return 1 end
redis.call('SET', KEYS[2], verdict)
for k = 6, #KEYS, 2 do
  if redis.call('EXISTS', KEYS[k]) == 1 then redis.call('RENAME', KEYS[k], KEYS[k + 1]) end
  redis.call('SET', KEYS[k], PLACEHOLDER)
end
return 0

--[[ gate: the first step of a put on one slot: decide whether its bytes may land.

A put on one slot is one MULTI/EXEC: this script, bar.lua, the HSETs of the rows' bytes, put.lua, then
unbar.lua. This one checks and leaves its verdict in td:{NAME}:gate: "go", or why not; bar.lua then
makes the HSETs fail unless it reads "go", put.lua marks the rows only on "go" and otherwise answers
with the verdict, and unbar.lua undoes bar.lua's work and the verdict. The put lands, whole, unless:
- the dock is gone or changed (NODOCK, SCHEMA), or a key it writes holds something else (CORRUPT);
- it is a resend of a put that already landed (its reply is kept, include/once.lua): rewriting the
  bytes could overwrite what another worker wrote since (a rollout's put gives unfinished rows back at
  once); put.lua answers with the kept reply;
- it names a delivery that is no longer current (include/delivery.lua): FENCED.

KEYS[1]         td:{NAME}:meta
KEYS[2]         td:{NAME}:gate                the verdict
KEYS[3]         td:{NAME}:epoch
KEYS[4]         td:{NAME}:gen
KEYS[5]         td:{NAME}:tokens:CONSUMER     of the delivery's lease (td:{NAME}:meta without one)
KEYS[6..]       td:{NAME}:data:COLUMN for each column written
last            td:{NAME}:reply:REQUEST_ID    the put's request id (include/once.lua; put.lua keeps the reply)
ARGV[1]         the schema the client expects (see include/schema.lua)
ARGV[2]         "1" if the put names a delivery (then ARGV[3..5] matter), else "0"
ARGV[3]         the delivery's epoch
ARGV[4]         the delivery's generations of the rows written, 4 bytes per row in run order
ARGV[5]         the token of the delivery's lease, or "" without one
ARGV[6..]       rows written, as runs: start, length, ... (ascending, disjoint)
last            how long put.lua keeps the reply, in ms (unused here)

Returns 1 if the bytes may land, else 0 (put.lua says why).
]]
-- @include bits
-- @include schema
-- @include delivery
-- @include once

local reply_key = once_args()
local verdict = schema_error(KEYS[1], ARGV[1])
if not verdict then verdict = wrong_type(2, 4, 'string') or wrong_type(5, #KEYS, 'hash') end
if not verdict and redis.call('EXISTS', reply_key) == 1 then verdict = '=replay' end
if not verdict and ARGV[2] == '1' then
  verdict = fenced_off(KEYS[3], KEYS[4], KEYS[5], tonumber(ARGV[3]), ARGV[4], ARGV[5], runs_from(6))
end
redis.call('SET', KEYS[2], verdict or 'go')
return verdict and 0 or 1

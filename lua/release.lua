--[[ release: give back rows a sampling call marked but could not deliver, because a clear took some
of its rows away between handing them out and reading their bytes (see fence.lua).

The caller then samples again, so the call either returns rows whose bytes were ready when it took
them, or nothing: never rows of the next batch under this call's marks, never rows twice. Only rows no
clear has touched since they were handed out are given back (a clear already reset the others), and
of those only rows still leased under this call's token when it leased them: a row a later call took
over stays with that call.

A release is done once per sampling call: it leaves "released" as the call's kept reply, and a resend
of it (after a lost reply) finds that and gives back nothing more. Without that a resend could give
back rows another worker of the consumer was handed meanwhile.

KEYS[1]     td:{NAME}:meta
KEYS[2]     td:{NAME}:consumed:CONSUMER
KEYS[3]     td:{NAME}:gtaken:CONSUMER
KEYS[4]     td:{NAME}:leases:CONSUMER
KEYS[5]     td:{NAME}:tokens:CONSUMER
KEYS[6]     td:{NAME}:epoch
KEYS[7]     td:{NAME}:gen
KEYS[8]     td:{NAME}:reply:REQUEST_ID       the kept reply of the sampling call
ARGV[1]     the schema the client expects (see include/schema.lua)
ARGV[2]     n_samples_per_prompt
ARGV[3]     the epoch sampling returned
ARGV[4]     the generations sampling returned
ARGV[5]     the call's lease token, or "" if it leased nothing
ARGV[6]     how long to keep the "released" mark, in ms
ARGV[7..]   the rows as runs: start, length, ... (ascending, disjoint)

Returns how many rows were given back.
]]
-- @include bits
-- @include schema
-- @include leases
-- @include generations

local wrong_schema = schema_error(KEYS[1], ARGV[1])
if wrong_schema then return redis.error_reply(wrong_schema) end
local bad = wrong_type(2, 3, 'string') or wrong_type(4, 4, 'zset') or wrong_type(5, 5, 'hash')
  or wrong_type(6, 8, 'string')
if bad then return redis.error_reply(bad) end

if redis.call('GET', KEYS[8]) == 'released' then return 0 end
redis.call('SET', KEYS[8], 'released', 'PX', ARGV[6])
local starts, lengths = runs_from(7)
local rows = unchanged_rows(KEYS[6], KEYS[7], tonumber(ARGV[3]), ARGV[4], starts, lengths)
if #rows == 0 then return 0 end
local token = ARGV[5]
if token ~= '' then
  local holders = hmget_in_chunks(KEYS[5], rows)
  local mine = {}
  for i = 1, #rows do
    if holders[i] == token then mine[#mine + 1] = rows[i] end
  end
  rows = mine
  drop_leases(KEYS[4], KEYS[5], rows)
end
give_back(KEYS[2], KEYS[3], rows, tonumber(ARGV[2]))
return #rows

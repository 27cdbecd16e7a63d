--[[ fence: read the epoch and the generations of rows, to check a read against clears.

The client sends this in the pipeline that reads the rows' bytes (HMGET), after the reads: if epoch
and generations still equal what sample or take returned when handing the rows out, no clear touched
the rows before the bytes were read, so they are the ones that were ready then; if not, a clear took
the rows away in between (see include/generations.lua). Reads nothing else and writes nothing.

KEYS[1]     td:{NAME}:meta
KEYS[2]     td:{NAME}:epoch
KEYS[3]     td:{NAME}:gen
ARGV[1]     the schema the client expects (see include/schema.lua)
ARGV[2..]   the rows as runs: start, length, ... (ascending, disjoint)

Returns {epoch, generations}: the epoch, and 4 bytes per row in run order.
]]
-- @include bits
-- @include schema
-- @include generations

local wrong_schema = schema_error(KEYS[1], ARGV[1])
if wrong_schema then return redis.error_reply(wrong_schema) end
local bad = wrong_type(2, 3, 'string')
if bad then return redis.error_reply(bad) end
local starts, lengths = runs_from(2)
return {epoch_of(KEYS[2]), generations_of_runs(KEYS[3], starts, lengths)}

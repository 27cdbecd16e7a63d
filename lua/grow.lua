--[[ grow: add columns or consumers to a dock, keeping its rows (MindSpeed's addition_columns and
addition_consumers on a dock that exists). Compare-and-set: it writes only if the dock still holds the
schema the client read, so two processes growing it at once never drop each other's names.

Clients that opened the dock before see its schema changed at their next script; they read the meta
again and go on when the dock only grew (see TransferDock._run).

KEYS[1]     td:{NAME}:meta
ARGV[1]     the schema the client read (see include/schema.lua)
ARGV[2]     the grown columns, JSON list (the old ones first, in their order)
ARGV[3]     the grown consumers, JSON list
ARGV[4]     the grown group columns, JSON list, or "" when the dock has none (the field stays absent)

Returns 1.
]]
-- @include schema

local wrong_schema = schema_error(KEYS[1], ARGV[1])
if wrong_schema then return redis.error_reply(wrong_schema) end
redis.call('HSET', KEYS[1], 'columns', ARGV[2], 'consumers', ARGV[3])
if ARGV[4] and ARGV[4] ~= '' then redis.call('HSET', KEYS[1], 'group_columns', ARGV[4]) end
return 1

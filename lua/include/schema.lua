--[[ schema: the check every script makes before anything else, pasted in by `-- @include schema`.

A dock object remembers the schema it was opened on. If the dock's meta hash vanished (FLUSHALL, a
DEL, a server restarted without persistence) or was edited by hand, writing on would scatter keys no
dock owns, or hand out rows outside the dock; so every script compares the stored schema with the
one the client sends and refuses to run on a mismatch. The client turns the NODOCK and SCHEMA
prefixes into DockNotFoundError and SchemaError.
]]

local SCHEMA_FIELDS = {'format_version', 'prompts_num', 'n_samples_per_prompt', 'columns', 'consumers',
  'length_columns', 'rollout', 'shards', 'group_columns'}

-- nil if `meta` holds the schema `expected` (its fields' values joined by newlines, in
-- SCHEMA_FIELDS order), else the error message to return.
local function schema_error(meta, expected)
  local t = redis.call('TYPE', meta)['ok']
  if t == 'none' then
    return 'NODOCK ' .. meta .. ' is gone: the dock was deleted or the server lost its data '
      .. '(FLUSHALL, or a restart without persistence)'
  end
  if t ~= 'hash' then return 'CORRUPT ' .. meta .. ' holds a ' .. t .. ', expected a hash' end
  local values = redis.call('HMGET', meta, unpack(SCHEMA_FIELDS))
  for i = 1, #SCHEMA_FIELDS do
    if not values[i] then values[i] = '<missing>' end
  end
  if table.concat(values, '\n') ~= expected then
    -- The client reads the meta again on this error and goes on if the dock only grew (see grow.lua).
    return 'SCHEMA ' .. meta .. ' no longer holds the schema this dock was opened with (edited, grown, or '
      .. 'the dock was recreated with another schema); open the dock again'
  end
  return nil
end

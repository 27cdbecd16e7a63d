--[[ quota: a dock's optional byte quota, pasted in by `-- @include quota` (put.lua, forget.lua's scripts,
set_quota.lua).

The meta hash's "quota_bytes" (absent: no quota, nothing counted) bounds "stored_bytes": the bytes of the
values in the dock's data and tail hashes, as HSTRLEN counts them (the rows' encoded bytes, a cut row's
head and tail both, one field per group of a group column). Set, they are kept by every script that
writes or deletes those values, in the same script, so the count is exact whatever runs at once:
- put.lua: a put adds its values' bytes, less what the fields it rewrites held (and deletes their stale
  tails, which a row rewritten whole would otherwise leave to the next forget), and is refused whole
  (QUOTA, nothing written) if the count would pass the quota; the first slice of a put in slices is
  checked for the whole put (its rest's rows and bytes in ARGV), so a put past the quota writes no slice;
- include/forget.lua (clear.lua, discard.lua): the fields a forget deletes, and the placeholders a
  regeneration writes; a whole clear sets the count to 0;
- set_quota.lua sets or removes the quota, counting what the dock holds then;
- restore.lua puts back the meta of the snapshot, its count with its rows.
A sharded dock's bytes live on other slots, which no script may read: the client refuses it a quota.

Counting costs an HSTRLEN per field written or deleted, in docks with a quota only.
]]
-- The dock's quota in bytes, or nil.
local function quota_of(meta)
  local q = redis.call('HGET', meta, 'quota_bytes')
  return q and tonumber(q) or nil
end
-- The bytes `fields` of hash `key` hold.
local function stored_in(key, fields)
  local total = 0
  for i = 1, #fields do total = total + redis.call('HSTRLEN', key, fields[i]) end
  return total
end
-- Adds `delta` to the dock's count of stored bytes.
local function count_stored(meta, delta)
  if delta ~= 0 then redis.call('HINCRBY', meta, 'stored_bytes', delta) end
end
-- The names of the dock's group columns (meta "group_columns", a JSON list), as a set.
local function group_column_names(meta)
  local named = {}
  local group_columns = redis.call('HGET', meta, 'group_columns')
  -- Names are letters, digits, '_', '.', '-' (keys.py check_name): the JSON list parses without cjson
  -- (which fakeredis lacks).
  if group_columns then
    for name in string.gmatch(group_columns, '"([^"]+)"') do named[name] = true end
  end
  return named
end

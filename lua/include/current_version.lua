--[[ current_version: the dock's policy version as stored, pasted in by `-- @include current_version`
(version.lua, sample.lua, prefetch.lua, discard.lua, status.lua).

A dock has no version key until its first set_version; until then its version is 0. version.lua also
marks the meta (field "versioned"), in the same script: from then on a missing version key was lost
(evicted by a server that evicts, deleted by hand, or lost in a failover), not unset. Reading 0 then
lets rows of any age through the staleness bound and lets the version move backwards, so it is an
error (LOST, the client's DataLostError). A dock made before the mark existed gets it at its next
set_version. A whole clear keeps the version key, and delete() removes it with the meta in one DEL.
]]

-- The version stored in `key` (0 when never set), or nil and the error message to return.
local function current_version(meta, key)
  local raw = redis.call('GET', key)
  if not raw then
    if redis.call('HMGET', meta, 'versioned')[1] then
      return nil, 'LOST ' .. key .. ' is gone although set_version set it: the server lost it (evicted under '
        .. 'a maxmemory-policy other than noeviction, deleted by hand, or lost in a failover); the dock\'s '
        .. 'other keys may be lost too: delete the dock and make it again'
    end
    return 0
  end
  local v = tonumber(raw)
  if not v then return nil, 'CORRUPT ' .. key .. ' holds no integer' end
  return v
end

--[[ bar: the second step of a put on one slot: bar its HSETs unless put.lua let them through.

Sent as text (EVAL), never by its hash, so it runs even when the server lost the other scripts
(a restart, a failover, SCRIPT FLUSH): if put.lua answered NOSCRIPT it left no "go", and the bytes of a
put nobody checked must not land. Redis has no conditional transaction (every command of a MULTI
runs), so a barred put's HSETs are made to fail instead: each data hash the put writes is set aside
(RENAME, O(1) whatever its size) and a string left in its place, on which HSET fails with WRONGTYPE,
writing nothing. unbar.lua, the put's last step, puts everything back. Keep it small: its text is sent
with every put.

KEYS[1]       td:{NAME}:gate               "go" from put.lua lets the bytes through
KEYS[2i]      a hash the put's HSETs write: td:{NAME}:data:COLUMN and td:{NAME}:tail:COLUMN per column
KEYS[2i+1]    where it is set aside: td:{NAME}:aside:COLUMN, td:{NAME}:tailaside:COLUMN

Returns 1 if the put's bytes may land, 0 if barred.
]]
if redis.call('GET', KEYS[1]) == 'go' then return 1 end
for k = 2, #KEYS, 2 do
  if redis.call('EXISTS', KEYS[k]) == 1 then redis.call('RENAME', KEYS[k], KEYS[k + 1]) end
  redis.call('SET', KEYS[k], 'barred by bar.lua until unbar.lua')
end
return 0

--[[ unbar: the last step of a put on one slot: undo what bar.lua did, and forget put.lua's "go".

Sent as text (EVAL) for the reason bar.lua is: it must run whatever scripts the server lost, or a
barred put would leave its data hashes aside. Keep it small: its text is sent with every put.

KEYS[1]       td:{NAME}:gate
KEYS[2i]      a hash the put's HSETs write: td:{NAME}:data:COLUMN and td:{NAME}:tail:COLUMN per column
KEYS[2i+1]    where it is set aside: td:{NAME}:aside:COLUMN, td:{NAME}:tailaside:COLUMN

Returns 1.
]]
if redis.call('GET', KEYS[1]) ~= 'go' then
  for k = 2, #KEYS, 2 do
    redis.call('DEL', KEYS[k])
    if redis.call('EXISTS', KEYS[k + 1]) == 1 then redis.call('RENAME', KEYS[k + 1], KEYS[k]) end
  end
end
redis.call('DEL', KEYS[1])
return 1

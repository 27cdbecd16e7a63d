--[[ once: a call applied once however often it is sent, pasted in by `-- @include once`.

A client whose connection drops after Redis ran a script, before the reply arrived, cannot tell
whether the script ran; its retry sends the same call again. Each call therefore carries a request id
(made once per call by the client, the same in every resend), and a script that includes this keeps
its reply under td:{NAME}:reply:ID for a while (ARGV, a minute by default): a resend finds it and gets
the same reply back instead of applying the call a second time (a cursor moved twice, a metric
appended twice, groups reserved and never returned, a group dropped twice, ...). Error replies are
not kept: a call that was refused changed nothing, and its resend is refused again or applies once.

Such a script takes the reply key as its LAST key and the time to keep the reply (ms) as its LAST
argument; `once_args` removes both from KEYS and ARGV, so the rest of the script reads its own
layout as its header gives it. Before them come the reply keys of earlier calls whose replies the
client has received (the argument before the last says how many, 0 or more; the keys are before the
reply key): those will never be asked for again, and are deleted when this call keeps its reply. So a slot holds about one kept
reply per client thread, not one per call of the last minute (hundreds, which a cluster moving the
slot to another node must carry over).

Replies are flat: a number, or a list of numbers and strings (strings may hold any bytes). They are
kept as text: "n" and the number, or "t" and per element "n<number>;" or "s<length>:<bytes>".
Numbers are integers (Redis truncates a script's numbers to integers anyway), written exactly.
]]
-- @include bits

-- Keys of replies the client has received, deleted when this call keeps its own (not by a refused call,
-- which changes nothing).
local received = {}

-- The reply key and the time to keep a reply, taken off the end of KEYS and ARGV, with the replies the
-- client received before (how many, and their keys) taken off for keep_reply.
local function once_args()
  local key, ttl = table.remove(KEYS), table.remove(ARGV)
  for i = 1, tonumber(table.remove(ARGV)) do
    received[i] = table.remove(KEYS)
  end
  return key, ttl
end

local function encode_reply(reply)
  if type(reply) == 'number' then return 'n' .. int_text(reply) end
  local parts = {'t'}
  for i = 1, #reply do
    local v = reply[i]
    if type(v) == 'number' then
      parts[#parts + 1] = 'n' .. int_text(v) .. ';'
    else
      parts[#parts + 1] = 's' .. #v .. ':' .. v
    end
  end
  return table.concat(parts)
end

-- The reply a call with this id already had, or nil if none is kept (or the key holds something else).
local function kept_reply(key)
  local text = redis.call('GET', key)
  if not text then return nil end
  local kind = string.sub(text, 1, 1)
  if kind == 'n' then return tonumber(string.sub(text, 2)) end
  if kind ~= 't' then return nil end
  local out, at = {}, 2
  while at <= #text do
    if string.sub(text, at, at) == 'n' then
      local stop = string.find(text, ';', at, true)
      out[#out + 1] = tonumber(string.sub(text, at + 1, stop - 1))
      at = stop + 1
    else
      local colon = string.find(text, ':', at, true)
      local length = tonumber(string.sub(text, at + 1, colon - 1))
      out[#out + 1] = string.sub(text, colon + 1, colon + length)
      at = colon + length + 1
    end
  end
  return out
end

-- Keeps `reply` for `ttl_ms` under `key` and returns it: a script's last step, `return keep_reply(...)`.
local function keep_reply(key, ttl_ms, reply)
  for _, done in ipairs(received) do redis.call('DEL', done) end
  redis.call('SET', key, encode_reply(reply), 'PX', ttl_ms)
  return reply
end

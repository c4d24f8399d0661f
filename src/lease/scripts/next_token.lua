-- Issues the next fencing token of a name: max(last token + 1, server time in µs),
-- stored back in the name's fence counter for `retention_ms`. Shared by every script
-- that issues tokens (prepended to them when they are loaded).
--
-- The +1 makes tokens strictly increase while the counter lives; the time floor keeps
-- them increasing when the counter is lost (a restart without persistence, eviction,
-- its own TTL), as long as the Redis server's clock does not step back. Lua numbers are
-- doubles: exact up to 2^53, which microseconds since 1970 reach in the year 2255.
--
-- Returns the token as a number and as the decimal string that is stored.
local function next_token(fence_key, retention_ms)
  local now = redis.call('TIME')
  local now_us = tonumber(now[1]) * 1000000 + tonumber(now[2])
  -- A counter that is missing, not a number or not even a string (garbage written by
  -- hand) counts as 0: the time floor still keeps tokens increasing. So does a number
  -- that no token of ours can be: negative, fractional, not finite (tonumber takes
  -- 'inf', 'nan' and '1e400') or past 2^53, where doubles stop counting by one. Such a
  -- number must not reach the reply: it would not convert to an integer, and an acquire
  -- that set its lease would look failed.
  local last = 0
  local kind = redis.call('TYPE', fence_key).ok
  if kind == 'string' then
    local n = tonumber(redis.call('GET', fence_key))
    if n ~= nil and n == n and n >= 0 and n < 9007199254740992 and n == math.floor(n) then
      last = n
    end
  elseif kind ~= 'none' then
    redis.call('DEL', fence_key)
  end
  local token = last + 1
  if token < now_us then
    token = now_us
  end
  local token_s = string.format('%d', token)
  redis.call('SET', fence_key, token_s, 'PX', retention_ms)
  return token, token_s
end


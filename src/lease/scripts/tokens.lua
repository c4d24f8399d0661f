-- Fencing tokens: how they are issued and how they are read back. Shared by every
-- script that issues or compares tokens (prepended to them when they are loaded).

-- Issues the next fencing token of a name: max(last token + 1, server time in µs,
-- `floor` if given), stored back in the name's fence counter for `retention_ms`.
--
-- The +1 makes tokens strictly increase while the counter lives; the time floor keeps
-- them increasing when the counter is lost (a restart without persistence, eviction,
-- its own TTL), as long as the Redis server's clock does not step back. Lua numbers are
-- doubles: exact up to 2^53, which microseconds since 1970 reach in the year 2255.
--
-- Returns the token as a number and as the decimal string that is stored.
local function next_token(fence_key, retention_ms, floor)
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
  if floor and token < floor then
    token = floor
  end
  local token_s = string.format('%d', token)
  redis.call('SET', fence_key, token_s, 'PX', retention_ms)
  return token, token_s
end

-- A token as read back from Redis, if it can be one of ours: a whole number, not beyond
-- the server's time by more than a minute (tokens are at most that time plus one per
-- acquire). Anything else (garbage, inf, nan) counts as 0: taken for a token, it would
-- refuse every write, or hide every entry, forever.
local function sane_token(t)
  if t == nil or t ~= t or t < 0 or t ~= math.floor(t) then
    return 0
  end
  local now = redis.call('TIME')
  if t > tonumber(now[1]) * 1000000 + tonumber(now[2]) + 60000000 then
    return 0
  end
  return t
end

-- The token kept at a string key (a fence counter, an invalidation's), or 0.
local function token_at(key)
  if redis.call('TYPE', key).ok ~= 'string' then
    return 0
  end
  return sane_token(tonumber(redis.call('GET', key)))
end


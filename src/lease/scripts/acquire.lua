-- Takes a lease if nobody holds it, and issues its fencing token, in one step.
--
-- KEYS[1]  the lease key       KEYS[2]  its fence counter (same hash slot)
-- ARGV[1]  owner value         ARGV[2]  lease TTL, ms    ARGV[3]  fence counter TTL, ms
--
-- Returns {1, token} when the lease was taken, {0, pttl} when it is held.
--
-- The token is max(last token + 1, server time in microseconds). The +1 makes tokens
-- strictly increase while the counter lives; the time floor keeps them increasing when
-- the counter is lost (a restart without persistence, eviction, its own TTL), as long as
-- the Redis server's clock does not step back. Lua numbers are doubles: exact up to 2^53,
-- which microseconds since 1970 reach in the year 2255.
local pttl = redis.call('PTTL', KEYS[1])
-- A key without a TTL (-1) is not a lease of ours (they always have one) but something
-- written by hand or by a bug; left alone it would block the name forever.
if pttl >= 0 then
  return {0, pttl}
end
local now = redis.call('TIME')
local now_us = tonumber(now[1]) * 1000000 + tonumber(now[2])
-- A counter that is missing, not a number or not even a string (garbage written by
-- hand) counts as 0: the time floor still keeps tokens increasing.
local last = 0
local kind = redis.call('TYPE', KEYS[2]).ok
if kind == 'string' then
  last = tonumber(redis.call('GET', KEYS[2])) or 0
elseif kind ~= 'none' then
  redis.call('DEL', KEYS[2])
end
local token = last + 1
if token < now_us then
  token = now_us
end
redis.call('SET', KEYS[2], string.format('%d', token), 'PX', ARGV[3])
redis.call('SET', KEYS[1], ARGV[1], 'PX', ARGV[2])
return {1, token}

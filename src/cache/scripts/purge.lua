-- Purges tags for the whole fleet, in one step: records when, and tells every instance.
--
-- KEYS[1]  the key space's purge records (a hash: field `{tag id}:h` or `{tag id}:s`,
--          the server time of the tag's last hard or soft purge, in µs)
-- KEYS[2]  the same fields by time (a sorted set), to prune old ones without a scan and
--          to read back what an instance missed (the two keys share a hash tag)
-- ARGV[1]  h (hard) or s (soft)    ARGV[2]  the notice channel
-- ARGV[3]  how long a record matters, µs: the longest an entry may be kept
-- ARGV[4..] the tags' ids (keyed hashes: no tag is written as given)
--
-- The time is the server's, the clock fencing tokens are issued from (tokens.lua): an
-- entry whose fill took its lease before the purge has a lower token, one that took it
-- after has a higher one. Every instance checks its entries' tags against the records
-- it heard (or, after its subscription was down, read back by time from the sorted set;
-- the hash is still written for versions that read it whole).
--
-- Records older than ARGV[3] hide nothing: each purge drops them, in time order (a
-- range of the sorted set, never a scan of the hash). Returns the purge's time, µs.
local now = redis.call('TIME')
local now_us = tonumber(now[1]) * 1000000 + tonumber(now[2])
local us = string.format('%d', now_us)
local ids = {}
for i = 4, #ARGV do
  local field = ARGV[i] .. ':' .. ARGV[1]
  redis.call('HSET', KEYS[1], field, us)
  redis.call('ZADD', KEYS[2], now_us, field)
  ids[#ids + 1] = ARGV[i]
end
local old = string.format('%d', now_us - tonumber(ARGV[3]))
local expired = redis.call('ZRANGEBYSCORE', KEYS[2], '-inf', '(' .. old, 'LIMIT', 0, 1000)
for _, field in ipairs(expired) do
  redis.call('HDEL', KEYS[1], field)
end
if #expired > 0 then
  redis.call('ZREM', KEYS[2], unpack(expired))
end
redis.call('PUBLISH', ARGV[2], 'p ' .. ARGV[1] .. ' ' .. us .. ' ' .. table.concat(ids, ' '))
return now_us

-- Purges tags for the whole fleet, in one step: records when, and tells every instance.
--
-- KEYS[1]  the key space's purge records (a hash: field `{tag id}:h` or `{tag id}:s`,
--          the server time of the tag's last hard or soft purge, in µs)
-- ARGV[1]  h (hard) or s (soft)    ARGV[2]  the notice channel
-- ARGV[3]  how long a record matters, µs: the longest an entry may be kept
-- ARGV[4..] the tags' ids (keyed hashes: no tag is written as given)
--
-- The time is the server's, the clock fencing tokens are issued from (tokens.lua): an
-- entry whose fill took its lease before the purge has a lower token, one that took it
-- after has a higher one. Every instance checks its entries' tags against the records
-- it heard (or, after its subscription was down, read back from this hash).
--
-- Records older than ARGV[3] hide nothing: they are pruned when the hash grows past
-- 10000 fields. Returns the purge's time, µs.
local now = redis.call('TIME')
local us = string.format('%d', tonumber(now[1]) * 1000000 + tonumber(now[2]))
local ids = {}
for i = 4, #ARGV do
  redis.call('HSET', KEYS[1], ARGV[i] .. ':' .. ARGV[1], us)
  ids[#ids + 1] = ARGV[i]
end
if redis.call('HLEN', KEYS[1]) > 10000 then
  local all = redis.call('HGETALL', KEYS[1])
  for i = 1, #all, 2 do
    if tonumber(all[i + 1]) == nil or tonumber(all[i + 1]) < tonumber(us) - tonumber(ARGV[3]) then
      redis.call('HDEL', KEYS[1], all[i])
    end
  end
end
redis.call('PUBLISH', ARGV[2], 'p ' .. ARGV[1] .. ' ' .. us .. ' ' .. table.concat(ids, ' '))
return tonumber(us)

-- Invalidates a cache entry for the whole fleet, in one step.
--
-- KEYS[1]  the entry key    KEYS[2]  its fence counter    KEYS[3]  where the token of
--          the last invalidation is kept (all in one hash slot)
-- ARGV[1]  the notice channel    ARGV[2]  how long the tombstone lasts, ms
-- ARGV[3]  how long the fence counter lasts, ms    ARGV[4]  how long the invalidation's
--          token lasts, ms: as long as any entry of the response may (it hides the
--          response's variants, which this script does not delete)
-- ARGV[5]  what the notice carries after the entry key: a space and the response's
--          local key (see `notify::Notice`)
--
-- The entry is replaced by a tombstone that carries a fresh fencing token (issued as
-- the lease script issues them, with next_token from tokens.lua, prepended when
-- loaded): a refresher that took its lease before the
-- invalidation, and so read the origin before it, has a lower token and its write is
-- refused; anyone who takes the lease afterwards gets a higher one. Readers see the
-- tombstone as a miss. Every instance is told to drop its local copy.
--
-- Returns {existed (0/1), the tombstone's token}.
local existed = 0
if redis.call('TYPE', KEYS[1]).ok == 'hash' and redis.call('HEXISTS', KEYS[1], 'd') == 1 then
  existed = 1
end
local token, token_s = next_token(KEYS[2], ARGV[3])
redis.call('SET', KEYS[3], token_s, 'PX', ARGV[4])
redis.call('DEL', KEYS[1])
redis.call('HSET', KEYS[1], 't', token_s, 'x', '1')
redis.call('PEXPIRE', KEYS[1], ARGV[2])
redis.call('PUBLISH', ARGV[1], 'i ' .. token_s .. ' ' .. KEYS[1] .. ARGV[5])
return {existed, token}

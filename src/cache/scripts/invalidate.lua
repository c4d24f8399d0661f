-- Invalidates a response for the whole fleet, its own entry and every variant, in one
-- step.
--
-- KEYS[1]  the response's own entry key    KEYS[2]  its fence counter    KEYS[3]  where
--          the token of the last invalidation is kept    KEYS[4]  the list of the
--          response's variants (all in one hash slot)
-- ARGV[1]  the notice channel    ARGV[2]  how long the tombstone lasts, ms
-- ARGV[3]  how long the fence counter lasts, ms    ARGV[4]  how long the invalidation's
--          token lasts, ms: as long as any entry of the response may (it hides the
--          variants that no list names: those written by a version that kept none)
-- ARGV[5]  what the notice carries after the entry key: a space and the response's
--          local key (see `notify::Notice`)
--
-- The entry is replaced by a tombstone that carries a fresh fencing token (issued as
-- the lease script issues them, with next_token from tokens.lua, prepended when
-- loaded): a refresher that took its lease before the
-- invalidation, and so read the origin before it, has a lower token and its write is
-- refused; anyone who takes the lease afterwards gets a higher one. Readers see the
-- tombstone as a miss. The entry's parts, if its body is kept in parts, go with it
-- (drop_parts). The variants the list names are deleted (drop_variants, from
-- variants.lua, prepended too, with their parts): a write of one that began before the invalidation
-- meets its token, kept at KEYS[3], and is refused just the same. Every instance is
-- told to drop its local copies.
--
-- The variants' keys are not among KEYS: they are made from the list's members, and
-- share the hash slot of KEYS[1] (its hash tag), so that on a Redis Cluster they live on
-- the node that runs the script. The time the script takes grows with the number of
-- variants listed.
--
-- Returns {existed (0/1): whether the own entry held an entry, the tombstone's token,
-- how many entries were removed: the own entry and the variants that held one}.
local existed = 0
if redis.call('TYPE', KEYS[1]).ok == 'hash' and redis.call('HEXISTS', KEYS[1], 'd') == 1 then
  existed = 1
end
local hidden_below = token_at(KEYS[3])
local removed = 0
if holds_entry(KEYS[1], hidden_below) then
  removed = 1
end
local base = string.sub(KEYS[1], 1, #KEYS[1] - #':entry')
removed = removed + drop_variants(KEYS[4], base, hidden_below)
local token, token_s = next_token(KEYS[2], ARGV[3])
redis.call('SET', KEYS[3], token_s, 'PX', ARGV[4])
drop_parts(KEYS[1], nil, nil)
redis.call('DEL', KEYS[1])
redis.call('HSET', KEYS[1], 't', token_s, 'x', '1')
redis.call('PEXPIRE', KEYS[1], ARGV[2])
redis.call('PUBLISH', ARGV[1], 'i ' .. token_s .. ' ' .. KEYS[1] .. ARGV[5])
return {existed, token, removed}

-- Renews a cache entry that the origin said is unchanged (a 304 to a conditional
-- refresh), without writing its body again; the release of the lease it was renewed
-- under and the notice to other instances, in one step.
--
-- KEYS[1]  the entry key    KEYS[2]  the lease key    KEYS[3]  the last invalidation's
--          token    KEYS[4]  the lease's fence counter    KEYS[5]  (for a variant of a
--          response) the list of the response's variants (all in one hash slot)
-- ARGV[1]  the renewer's fencing token    ARGV[2]  the renewer's owner value
-- ARGV[3]  the token of the entry that was revalidated
-- ARGV[4]  the entry's new metadata (an encoded entry without a body)
-- ARGV[5]  how long to keep it from now, ms
-- ARGV[6]  the key's interest channel    ARGV[7]  the notice of a write (on it)
-- ARGV[8]  the broadcast channel    ARGV[9]  the notice of a lease that ended without
--          one (on it)
-- ARGV[10] the digest the stored body must have ('' for any: the origin said it is
--          unchanged); a 200 whose body has the digest of the stored body renews it
--          without writing its parts again
-- ARGV[11] (with KEYS[5]) the variant's part of its entry key, as the list holds it
--
-- Fenced as write.lua is: refused when a higher token was stored or issued (then the
-- lease is released as there). When the entry that was revalidated is no longer there
-- (expired, evicted, or replaced by another writer; for a body sent again, when the
-- entry's body has another digest), nothing is done and the lease is kept: the caller
-- writes the whole entry instead, with the body it holds.
--
-- The metadata goes in field m beside the body in d (and t becomes the renewer's
-- token); read.lua gives both, and a whole write (write.lua) replaces both.
--
-- Returns {renewed (1), refused (0) or gone (-1), released (0/1), the highest token it
-- was measured against}. The token helpers (tokens.lua) are prepended when loaded.
local token = tonumber(ARGV[1])
local current = nil
if redis.call('TYPE', KEYS[1]).ok == 'hash' and redis.call('PTTL', KEYS[1]) >= 0
    and redis.call('HEXISTS', KEYS[1], 'd') == 1 then
  current = sane_token(tonumber(redis.call('HGET', KEYS[1], 't')))
end
local stored = current or 0
stored = math.max(stored, token_at(KEYS[3]))
stored = math.max(stored, token_at(KEYS[4]))
if token < stored then
  local released = 0
  if redis.call('TYPE', KEYS[2]).ok == 'string' and redis.call('GET', KEYS[2]) == ARGV[2] then
    redis.call('DEL', KEYS[2])
    redis.call('PUBLISH', ARGV[8], ARGV[9])
    released = 1
  end
  return {0, released, stored}
end
if current == nil then
  return {-1, 0, stored}
end
if ARGV[10] ~= '' then
  -- A body the origin sent again: its parts are the entry's whoever wrote or renewed
  -- it last (another instance may have, with the same body), if their digest is its.
  if redis.call('HGET', KEYS[1], 'h') ~= ARGV[10] then
    return {-1, 0, stored}
  end
elseif current ~= tonumber(ARGV[3]) then
  return {-1, 0, stored}
end
redis.call('HSET', KEYS[1], 't', ARGV[1], 'm', ARGV[4])
redis.call('PEXPIRE', KEYS[1], ARGV[5])
-- A body kept in parts lives as long as its entry (keep_parts: variants.lua).
keep_parts(KEYS[1], ARGV[5])
-- The list lasts as long as the entry now does (see write.lua).
if KEYS[5] then
  list_variant(KEYS[5], ARGV[11], ARGV[5])
end
local released = 0
if redis.call('TYPE', KEYS[2]).ok == 'string' and redis.call('GET', KEYS[2]) == ARGV[2] then
  redis.call('DEL', KEYS[2])
  released = 1
end
redis.call('PUBLISH', ARGV[6], ARGV[7])
return {1, released, stored}

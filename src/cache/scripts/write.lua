-- The fenced write of a cache entry, the release of the lease it was made under, and
-- the notice to other instances, in one step.
--
-- KEYS[1]  the entry key    KEYS[2]  the lease key    KEYS[3]  the last invalidation's
--          token    KEYS[4]  the lease's fence counter    KEYS[5]  (for a variant of a
--          response) the list of the response's variants (all in one hash slot)
-- ARGV[1]  the writer's fencing token    ARGV[2]  the writer's owner value
-- ARGV[3]  the encoded entry    ARGV[4]  how long to keep it, ms
-- ARGV[5]  the key's interest channel    ARGV[6]  the notice of a write (on it)
-- ARGV[7]  the broadcast channel    ARGV[8]  the notice of a lease that ended without
--          one (on it)
-- ARGV[9]  how many parts the body is kept in beside the entry, written already under
--          this token (0: the body is in the entry)
-- ARGV[10] the digest of a body kept in parts (field h: a renewal checks it, see
--          revalidate.lua)    ARGV[11] how long a reader at the slowest rate it is
--          given takes to read one part, ms (see drop_parts)
-- ARGV[12] (with KEYS[5]) the variant's part of its entry key, as the list holds it
--
-- A variant that is written is listed (see list_variant), so that an invalidation of
-- its response deletes it and counts it (see invalidate.lua). The entry it replaces
-- leaves its parts to linger (drop_parts), unless they are this write's own, for the
-- answers that are streaming them: long enough to be read whole at the slowest rate,
-- and named by the new entry (lg, lp; the one that lingered before becomes og, op), so
-- that two generations linger at most (the next replacement deletes the older).
--
-- The entry is written only if no higher token was stored or issued: a writer whose
-- lease expired while it worked, and who was overtaken, cannot replace the newer entry,
-- nor write after a newer holder took the lease (even if that holder's entry has been
-- evicted or has expired since, or it never wrote one). The lease is released either
-- way, if it is still the writer's; if nothing was written, the instances waiting for
-- the entry are told, so that they stop waiting. The notice of a write goes to the
-- instances that listen to the key's bucket (those that wait for it); that of a lease
-- that ended without one to every instance (see notify.rs).
--
-- Returns {written (0/1), released (0/1), the highest token it was measured against:
-- the stored entry's, the last invalidation's or the last issued}. The token helpers
-- (tokens.lua) are prepended when the script is loaded.
local token = tonumber(ARGV[1])
local stored = 0
if redis.call('TYPE', KEYS[1]).ok == 'hash' and redis.call('PTTL', KEYS[1]) >= 0 then
  stored = sane_token(tonumber(redis.call('HGET', KEYS[1], 't')))
end
-- A write that Redis runs late (queued behind a stall) must not undo an invalidation
-- whose tombstone has expired since: the invalidation's token outlives it.
stored = math.max(stored, token_at(KEYS[3]))
-- The last token issued for the lease: a newer holder exists if it is above ours.
stored = math.max(stored, token_at(KEYS[4]))
local written = 0
if token >= stored then
  local newer, older = drop_parts(KEYS[1], ARGV[1], ARGV[11])
  -- DEL first: the key may hold garbage of another type.
  redis.call('DEL', KEYS[1])
  redis.call('HSET', KEYS[1], 't', ARGV[1], 'd', ARGV[3])
  if tonumber(ARGV[9]) > 0 then
    redis.call('HSET', KEYS[1], 'g', ARGV[1], 'p', ARGV[9], 'h', ARGV[10])
  end
  -- The replaced entries' parts, left to linger: the second replacement deletes them.
  if newer then
    redis.call('HSET', KEYS[1], 'lg', newer[1], 'lp', newer[2])
  end
  if older then
    redis.call('HSET', KEYS[1], 'og', older[1], 'op', older[2])
  end
  redis.call('PEXPIRE', KEYS[1], ARGV[4])
  written = 1
  if KEYS[5] then
    list_variant(KEYS[5], ARGV[12], ARGV[4])
  end
end
local released = 0
if redis.call('TYPE', KEYS[2]).ok == 'string' and redis.call('GET', KEYS[2]) == ARGV[2] then
  redis.call('DEL', KEYS[2])
  released = 1
end
if written == 1 then
  redis.call('PUBLISH', ARGV[5], ARGV[6])
elseif released == 1 then
  redis.call('PUBLISH', ARGV[7], ARGV[8])
end
return {written, released, stored}

-- Takes a lease if nobody holds it, and issues its fencing token, in one step.
--
-- KEYS[1]  the lease key       KEYS[2]  its fence counter (same hash slot)
-- ARGV[1]  owner value         ARGV[2]  lease TTL, ms    ARGV[3]  fence counter TTL, ms
-- ARGV[4]  the value of a held-off lease (see hold_off.lua)
--
-- For the lease of a cache entry's fill, also (all in the same hash slot):
-- KEYS[3]  the entry    KEYS[4]  its response's invalidation token
-- KEYS[5]  its response's fence counter (the invalidation script issues from it; the
--          same key as KEYS[2] unless the entry is one variant of a response)
-- ARGV[5]  the token of the entry the caller found (0 for none)
--
-- Returns {1, token} when the lease was taken, {0, pttl, held_off (0/1)} when it is
-- held, and {2, 0} when the entry was written since its caller looked (a newer token
-- than it found, and not invalidated since): the work is done, the lease is not taken.
-- The caller's look and this acquire are two round trips; another instance's whole fill
-- can land between them, and its notice come after this reply.
--
-- A fill's token is above its response's last invalidation, and the response's counter
-- is raised to it: an invalidation after this acquire issues a token above it, so the
-- two are ordered even when they fall in the same microsecond, or the server's clock
-- steps back. (next_token, token_at: tokens.lua, prepended when loaded.)
--
-- The token comes from next_token (tokens.lua, prepended when loaded).
local invalidated = 0
if KEYS[3] then
  invalidated = token_at(KEYS[4])
  if redis.call('TYPE', KEYS[3]).ok == 'hash' and redis.call('HEXISTS', KEYS[3], 'd') == 1
      and redis.call('HEXISTS', KEYS[3], 'x') == 0 then
    -- Read as every script reads a token (sane_token, tokens.lua): garbage there
    -- (1e300, inf) would otherwise look newer than anything, forever.
    local written = sane_token(tonumber(redis.call('HGET', KEYS[3], 't')))
    if written > 0 and written > (tonumber(ARGV[5]) or 0) and written >= invalidated then
      return {2, 0}
    end
  end
end
local pttl = redis.call('PTTL', KEYS[1])
-- A key without a TTL (-1) is not a lease of ours (they always have one) but something
-- written by hand or by a bug; left alone it would block the name forever.
if pttl >= 0 then
  local held_off = 0
  if redis.call('TYPE', KEYS[1]).ok == 'string' and redis.call('GET', KEYS[1]) == ARGV[4] then
    held_off = 1
  end
  return {0, pttl, held_off}
end
local token, token_s = next_token(KEYS[2], ARGV[3], invalidated + 1)
redis.call('SET', KEYS[1], ARGV[1], 'PX', ARGV[2])
if KEYS[5] and KEYS[5] ~= KEYS[2] and token_at(KEYS[5]) < token then
  redis.call('SET', KEYS[5], token_s, 'PX', ARGV[3])
end
return {1, token}

-- Takes a lease if nobody holds it, and issues its fencing token, in one step.
--
-- KEYS[1]  the lease key       KEYS[2]  its fence counter (same hash slot)
-- ARGV[1]  owner value         ARGV[2]  lease TTL, ms    ARGV[3]  fence counter TTL, ms
-- ARGV[4]  the value of a held-off lease (see hold_off.lua)
-- KEYS[3], ARGV[5]  (optional) the cache entry the lease is for, and the token of the
--          entry its caller found (0 for none)
--
-- Returns {1, token} when the lease was taken, {0, pttl, held_off (0/1)} when it is
-- held, and {2, 0} when the entry was written since its caller looked (a newer token
-- than it found): the work is done, the lease is not taken. The caller's look and this
-- acquire are two round trips; another instance's whole fill can land between them, and
-- its notice come after this reply.
--
-- The token comes from next_token (next_token.lua, prepended when loaded).
if KEYS[3] and redis.call('TYPE', KEYS[3]).ok == 'hash'
    and redis.call('HEXISTS', KEYS[3], 'd') == 1 and redis.call('HEXISTS', KEYS[3], 'x') == 0 then
  local written = tonumber(redis.call('HGET', KEYS[3], 't'))
  if written and written > tonumber(ARGV[5]) then
    return {2, 0}
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
local token = next_token(KEYS[2], ARGV[3])
redis.call('SET', KEYS[1], ARGV[1], 'PX', ARGV[2])
return {1, token}

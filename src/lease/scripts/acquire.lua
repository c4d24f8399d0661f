-- Takes a lease if nobody holds it, and issues its fencing token, in one step.
--
-- KEYS[1]  the lease key       KEYS[2]  its fence counter (same hash slot)
-- ARGV[1]  owner value         ARGV[2]  lease TTL, ms    ARGV[3]  fence counter TTL, ms
-- ARGV[4]  the value of a held-off lease (see hold_off.lua)
--
-- Returns {1, token} when the lease was taken, {0, pttl, held_off (0/1)} when it is
-- held.
--
-- The token comes from next_token (next_token.lua, prepended when loaded).
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

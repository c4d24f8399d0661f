-- Extends a lease, only for its owner.
--
-- KEYS[1]  the lease key    ARGV[1]  owner value    ARGV[2]  new TTL, ms
--
-- Returns 1 when renewed, 0 when the lease is gone or held by someone else.
-- TYPE first: GET on a key of another type would be an error, not a 'no'.
if redis.call('TYPE', KEYS[1]).ok == 'string' and redis.call('GET', KEYS[1]) == ARGV[1] then
  redis.call('PEXPIRE', KEYS[1], ARGV[2])
  return 1
end
return 0

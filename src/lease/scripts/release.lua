-- Gives a lease back, only for its owner: a holder whose lease expired must not delete
-- the lease someone else took since.
--
-- KEYS[1]  the lease key    ARGV[1]  owner value
--
-- Returns 1 when released, 0 when the lease is gone or held by someone else.
-- TYPE first: GET on a key of another type would be an error, not a 'no'.
if redis.call('TYPE', KEYS[1]).ok == 'string' and redis.call('GET', KEYS[1]) == ARGV[1] then
  return redis.call('DEL', KEYS[1])
end
return 0

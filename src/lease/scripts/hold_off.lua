-- Gives a lease up to nobody: the name stays taken for a while, but no one owns it.
--
-- KEYS[1]  the lease key    ARGV[1]  owner value    ARGV[2]  how long it stays taken, ms
--          ARGV[3]  the value a held-off lease holds (never an owner value)
--
-- After a failure, the holder keeps the fleet away from the work for a while without
-- having to come back to release it: the key ends by its TTL, and acquires meanwhile
-- answer busy (and say it is held off). Only the owner can do it.
--
-- Returns 1 when done, 0 when the lease is gone or held by someone else.
if redis.call('TYPE', KEYS[1]).ok == 'string' and redis.call('GET', KEYS[1]) == ARGV[1] then
  redis.call('SET', KEYS[1], ARGV[3], 'PX', ARGV[2])
  return 1
end
return 0

-- Deletes a cache entry and tells every instance to drop its local copy.
--
-- KEYS[1]  the entry key    ARGV[1]  the notice channel    ARGV[2]  the notice
--
-- Returns how many keys were deleted (0 or 1).
local deleted = redis.call('DEL', KEYS[1])
redis.call('PUBLISH', ARGV[1], ARGV[2])
return deleted

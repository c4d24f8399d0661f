-- Reads a part of a body kept in parts (see `cache::entry`).
--
-- KEYS[1]  the part's key
--
-- Returns the part, or false when there is none or the key holds another type (garbage:
-- the read is then a miss, never an error).
if redis.call('TYPE', KEYS[1]).ok ~= 'string' then
  return false
end
return redis.call('GET', KEYS[1])

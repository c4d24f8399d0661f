-- Deletes the parts of one generation of an entry's body that its fill wrote but did
-- not get stored (its answer was cut, not stored, or its write refused or lost), so
-- that they do not wait out their keep time; unless the entry names that generation,
-- as its body's or as the one that lingers for its readers: a write whose reply was
-- lost may have stored the entry after all, and its parts are then the entry's.
--
-- KEYS[1]  the entry key (its parts are KEYS[1]:p:<generation>:<index>, in its slot)
-- ARGV[1]  the generation (the fill's fencing token)    ARGV[2]  how many parts, from 0
--
-- Returns 1 if they were deleted, 0 if the entry names them (kept). The helpers of
-- variants.lua (parts_go) are prepended when the script is loaded.
local generation = ARGV[1]
if redis.call('TYPE', KEYS[1]).ok == 'hash' then
  -- (HGET each: the key space's least privileged user has no HMGET.)
  for _, field in ipairs({'g', 'lg', 'og'}) do
    if redis.call('HGET', KEYS[1], field) == generation then
      return 0
    end
  end
end
parts_go(KEYS[1], generation, tonumber(ARGV[2]), nil)
return 1

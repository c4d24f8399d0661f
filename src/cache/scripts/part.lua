-- The fenced write of one part of a body kept in parts (see `cache::entry`), before the
-- entry that names them is written (by write.lua, which fences the same way).
--
-- KEYS[1]  the entry key    KEYS[2]  the last invalidation's token    KEYS[3]  the
--          lease's fence counter    KEYS[4]  the part's key (all in one hash slot)
-- ARGV[1]  the writer's fencing token (the parts' generation, in their keys)
-- ARGV[2]  the part    ARGV[3]  how long to keep it, ms
--
-- Written only if no higher token was stored or issued, as the entry is: a writer that
-- was overtaken writes no part. Parts are named by their generation, so that no part
-- of one fill ever replaces a part of another: a reader takes only the generation its
-- entry names.
--
-- Returns 1 if written, 0 if refused. The token helpers (tokens.lua) are prepended when
-- the script is loaded.
local token = tonumber(ARGV[1])
local stored = 0
if redis.call('TYPE', KEYS[1]).ok == 'hash' and redis.call('PTTL', KEYS[1]) >= 0 then
  stored = sane_token(tonumber(redis.call('HGET', KEYS[1], 't')))
end
stored = math.max(stored, token_at(KEYS[2]), token_at(KEYS[3]))
if token < stored then
  return 0
end
redis.call('SET', KEYS[4], ARGV[2], 'PX', ARGV[3])
return 1

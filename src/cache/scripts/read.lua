-- Reads a cache entry with its remaining TTL, in one round trip.
--
-- KEYS[1]  the entry key (a hash: t = fencing token of its writer, d = the entry, and
--          m = newer metadata when a 304 renewed it, see revalidate.lua)
-- KEYS[2]  where the token of the response's last invalidation is kept (the same key
--          for every variant of a response, in the same hash slot)
-- KEYS[3]  (optional: for a read of the response's own entry, or on a route with keyed
--          headers of any entry) where the names of the headers the response varies on
--          are kept (see vary.lua), in the same slot
--
-- An entry written before the response's last invalidation is a miss: that is how one
-- invalidation reaches every variant of a response, without a list of them.
--
-- Returns an empty array when there is no entry (or only an invalidation's tombstone),
-- {-3} when the key holds something that is not an entry of ours (another type, or a
-- hash without data), {pttl, data} otherwise, or {pttl, data, metadata} for a renewed
-- entry. With KEYS[3], when names are kept there: {-4, names} for no entry, and
-- {pttl, data, metadata or '', names} for one ({-3} stays {-3}).
local names = nil
if KEYS[3] and redis.call('TYPE', KEYS[3]).ok == 'string' then
  names = redis.call('GET', KEYS[3])
end
local kind = redis.call('TYPE', KEYS[1]).ok
local missing = nil
if kind == 'none' then
  missing = true
elseif kind ~= 'hash' then
  return {-3}
elseif redis.call('HEXISTS', KEYS[1], 'x') == 1 then
  missing = true
end
local data = nil
if not missing then
  data = redis.call('HGET', KEYS[1], 'd')
  if not data then
    return {-3}
  end
  -- (token_at and sane_token: tokens.lua, prepended when the script is loaded.)
  if sane_token(tonumber(redis.call('HGET', KEYS[1], 't'))) < token_at(KEYS[2]) then
    missing = true
  end
end
if missing then
  if names then
    return {-4, names}
  end
  return {}
end
local meta = redis.call('HGET', KEYS[1], 'm')
if names then
  return {redis.call('PTTL', KEYS[1]), data, meta or '', names}
end
if meta then
  return {redis.call('PTTL', KEYS[1]), data, meta}
end
return {redis.call('PTTL', KEYS[1]), data}

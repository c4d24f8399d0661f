-- Checks the parts of a body kept in parts (see `cache::parts`) without reading their
-- bytes: each must be a string of its length that opens with its header (its entry's
-- generation and its index).
--
-- KEYS[i]       part i-1's key
-- ARGV[2i-1]    the header it must open with
-- ARGV[2i]      its length, header included
--
-- Returns 1 when every part is whole, else 0.
for i, key in ipairs(KEYS) do
  if redis.call('TYPE', key).ok ~= 'string' then
    return 0
  end
  if redis.call('STRLEN', key) ~= tonumber(ARGV[2 * i]) then
    return 0
  end
  if redis.call('GETRANGE', key, 0, string.len(ARGV[2 * i - 1]) - 1) ~= ARGV[2 * i - 1] then
    return 0
  end
end
return 1

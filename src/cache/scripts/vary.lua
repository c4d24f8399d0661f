-- Keeps the names of the headers a response varies on, beside its entries (see
-- `guard::vary`): what was kept, and what is given, in one sorted list.
--
-- KEYS[1]  the response's record of names (a string: names joined by commas; in the
--          hash slot of its entries)
-- ARGV[1]  how long to keep it at least, ms (as long as an entry of the response may)
-- ARGV[2..] the names learned
--
-- Names only grow. A record that is not a string of ours (another type, written by
-- hand) is replaced. Returns how many names are kept.
local kept = {}
local names = {}
local kind = redis.call('TYPE', KEYS[1]).ok
local left = -2
if kind == 'string' then
  left = redis.call('PTTL', KEYS[1])
  for name in string.gmatch(redis.call('GET', KEYS[1]), '[^,]+') do
    if not kept[name] then
      kept[name] = true
      names[#names + 1] = name
    end
  end
elseif kind ~= 'none' then
  redis.call('DEL', KEYS[1])
end
for i = 2, #ARGV do
  if not kept[ARGV[i]] then
    kept[ARGV[i]] = true
    names[#names + 1] = ARGV[i]
  end
end
table.sort(names)
local ttl = tonumber(ARGV[1])
if left > ttl then
  ttl = left
end
redis.call('SET', KEYS[1], table.concat(names, ','), 'PX', ttl)
return #names

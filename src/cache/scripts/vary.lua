-- Keeps the names of the headers a response varies on, beside its entries (see
-- `guard::vary`): what was kept, and what is given, in one sorted list.
--
-- KEYS[1]  the response's record of names (a string: names joined by commas; in the
--          hash slot of its entries)
-- ARGV[1]  how long to keep it at least, ms (as long as an entry of the response may)
-- ARGV[2]  the most names a response may vary on
-- ARGV[3..] the names learned
--
-- Names only grow, up to ARGV[2]: names that would take the record past it are not
-- added (the response is not stored then anyway). What is not a header name (garbage
-- written by hand) is dropped, and a record of another type is replaced. Returns how
-- many names are kept.
local most = tonumber(ARGV[2])
local kept = {}
local names = {}
local function add(name)
  if not kept[name] and #names < most and string.match(name, "^[%w!#$%%&'*+%-.^_`|~]+$") then
    kept[name] = true
    names[#names + 1] = name
  end
end
local kind = redis.call('TYPE', KEYS[1]).ok
local left = -2
if kind == 'string' then
  left = redis.call('PTTL', KEYS[1])
  for name in string.gmatch(redis.call('GET', KEYS[1]), '[^,]+') do
    add(string.lower(name))
  end
elseif kind ~= 'none' then
  redis.call('DEL', KEYS[1])
end
for i = 3, #ARGV do
  add(ARGV[i])
end
table.sort(names)
local ttl = tonumber(ARGV[1])
if left > ttl then
  ttl = left
end
redis.call('SET', KEYS[1], table.concat(names, ','), 'PX', ttl)
return #names

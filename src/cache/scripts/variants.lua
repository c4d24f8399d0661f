-- The list of a response's variants (`CacheKeys::variants_key`): a set of the variant
-- part of each variant's entry key (`v_` and a keyed hash), in the hash slot of the
-- response's entries, kept at least as long as every entry it lists. Shared by the
-- scripts that write variants and by the invalidation that deletes them (prepended to
-- them when they are loaded, after tokens.lua); and the parts of a body kept in parts,
-- which go with their entry.

-- At most this many variants are listed per response: the list (and the invalidation
-- that walks it, in one script) stays bounded whatever values clients send in a keyed
-- header. A variant written past it is not listed: an invalidation still hides it (the
-- invalidation's token is above its own), but neither deletes nor counts it.
local MAX_LISTED = 1024

-- Lists variant `part` in `list`, and keeps the list at least `keep_ms` more (a list of
-- another type, garbage written by hand, is replaced).
local function list_variant(list, part, keep_ms)
  local kind = redis.call('TYPE', list).ok
  if kind ~= 'set' and kind ~= 'none' then
    redis.call('DEL', list)
  end
  if redis.call('SCARD', list) >= MAX_LISTED and redis.call('SISMEMBER', list, part) == 0 then
    return
  end
  redis.call('SADD', list, part)
  if redis.call('PTTL', list) < tonumber(keep_ms) then
    redis.call('PEXPIRE', list, keep_ms)
  end
end

-- Whether `key` holds an entry (not a tombstone, nor garbage) written at or after
-- `hidden_below` (the token of the response's last invalidation: an older entry was
-- hidden by it already).
local function holds_entry(key, hidden_below)
  if redis.call('TYPE', key).ok ~= 'hash' or redis.call('HEXISTS', key, 'd') == 0 then
    return false
  end
  return sane_token(tonumber(redis.call('HGET', key, 't'))) >= hidden_below
end

-- Deletes `count` parts of generation `generation` of the entry at `key`, or with
-- `linger` (ms) sets them to go in that long (longer or shorter than they had left).
local function parts_go(key, generation, count, linger)
  -- (At most a body limit's worth: 64 MiB in parts of 512 KiB.)
  for i = 0, math.min(count, 128) - 1 do
    local part = key .. ':p:' .. generation .. ':' .. i
    if linger then
      redis.call('PEXPIRE', part, linger)
    else
      redis.call('DEL', part)
    end
  end
end

-- How long a generation of `count` parts lingers once replaced: what a reader at the
-- slowest rate it is given (`per_part` ms for each part) needs to read all of it, and
-- ten seconds more.
local function lingering_for(count, per_part)
  return count * tonumber(per_part) + 10000
end

-- The parts of the body of the entry at `key` (a body kept in parts: the entry's fields
-- g, its generation, and p, how many), and the generations replaced bodies left to
-- linger for their readers (lg and lp, the newer; og and op, the older), when a write is
-- about to replace it (`per_part`: see lingering_for) or it is deleted (`per_part` nil).
-- Parts of generation `keep` (those the write is about to name) are left alone.
--
-- Deleted: every generation, or, on a replacement, the older lingering one; the newer
-- becomes the older, and the entry's own lingers, long enough for a reader at the
-- slowest rate to read it whole (set whatever its parts had left: a reader that began
-- late in the entry's life finishes too). Returned: the generations that linger now,
-- newer first ({generation, count} or nil each), for the new entry to name. At most
-- three generations of a key's body are thus in Redis: its own, and two lingering.
local function drop_parts(key, keep, per_part)
  if redis.call('TYPE', key).ok ~= 'hash' then
    return
  end
  -- (HGET each: the least privileged user the key space's ACL rules allow has no HMGET.)
  local function field(name)
    return redis.call('HGET', key, name)
  end
  local current = {field('g'), tonumber(field('p'))}
  local newer = {field('lg'), tonumber(field('lp'))}
  local older = {field('og'), tonumber(field('op'))}
  local function usable(generation)
    return generation[1] and generation[2] and generation[1] ~= keep
  end
  if usable(older) then
    parts_go(key, older[1], older[2], nil)
  end
  if not per_part then
    for _, generation in ipairs({newer, current}) do
      if usable(generation) then
        parts_go(key, generation[1], generation[2], nil)
      end
    end
    return
  end
  if not usable(current) then
    if usable(newer) then
      return newer
    end
    return
  end
  parts_go(key, current[1], current[2], lingering_for(current[2], per_part))
  if usable(newer) then
    return current, newer
  end
  return current
end

-- Keeps the parts of the body of the entry at `key` (if it is kept in parts) `ms`
-- milliseconds and a second more, as long as a renewal keeps the entry.
local function keep_parts(key, ms)
  local generation = redis.call('HGET', key, 'g')
  local count = tonumber(redis.call('HGET', key, 'p'))
  if not generation or not count then
    return
  end
  for i = 0, math.min(count, 128) - 1 do
    redis.call('PEXPIRE', key .. ':p:' .. generation .. ':' .. i, tonumber(ms) + 1000)
  end
end

-- Deletes every variant `list` names (the entry keys `{base}:{part}:entry`, in the
-- list's hash slot), and the list. Returns how many of them held an entry (see
-- holds_entry).
local function drop_variants(list, base, hidden_below)
  local kind = redis.call('TYPE', list).ok
  if kind ~= 'set' then
    if kind ~= 'none' then
      redis.call('DEL', list)
    end
    return 0
  end
  local dropped = 0
  for _, part in ipairs(redis.call('SMEMBERS', list)) do
    -- Only what a write lists: anything else was not put there by the crate.
    if string.match(part, '^v_%x+$') then
      local key = base .. ':' .. part .. ':entry'
      if holds_entry(key, hidden_below) then
        dropped = dropped + 1
      end
      drop_parts(key, nil, nil)
      redis.call('DEL', key)
    end
  end
  redis.call('DEL', list)
  return dropped
end

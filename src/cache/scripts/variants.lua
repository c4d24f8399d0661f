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
-- `linger` (ms) keeps them that long at most (without PEXPIRE's LT: Redis 6 has none).
local function parts_go(key, generation, count, linger)
  -- (At most a body limit's worth: 64 MiB in parts of 512 KiB.)
  for i = 0, math.min(count, 128) - 1 do
    local part = key .. ':p:' .. generation .. ':' .. i
    if linger then
      local left = redis.call('PTTL', part)
      if left == -1 or left > linger then
        redis.call('PEXPIRE', part, linger)
      end
    else
      redis.call('DEL', part)
    end
  end
end

-- Deletes the parts of the body of the entry at `key` (a body kept in parts: the
-- entry's fields g, its generation, and p, how many), unless they are of generation
-- `keep` (the parts a write is about to name), and those of the generation it let
-- linger (fields lg and lp). Given `linger` (ms: a newer entry replaces this one), its
-- own are kept that long at most instead, so that the answers that stream them part by
-- part (cache/parts.rs) end whole; they are then the only generation that lingers, and
-- their generation and count are returned, for the new entry to name (lg, lp).
local function drop_parts(key, keep, linger)
  if redis.call('TYPE', key).ok ~= 'hash' then
    return
  end
  local lingering = redis.call('HGET', key, 'lg')
  local lingering_count = tonumber(redis.call('HGET', key, 'lp'))
  if lingering and lingering_count and lingering ~= keep then
    parts_go(key, lingering, lingering_count, nil)
  end
  local generation = redis.call('HGET', key, 'g')
  local count = tonumber(redis.call('HGET', key, 'p'))
  if not generation or not count or generation == keep then
    return
  end
  parts_go(key, generation, count, linger)
  if linger then
    return generation, count
  end
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
      drop_parts(key, nil)
      redis.call('DEL', key)
    end
  end
  redis.call('DEL', list)
  return dropped
end

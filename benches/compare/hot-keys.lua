-- wrk: requests spread over KEYS hot keys (default 4), each connection starting at its
-- own place.
local keys = tonumber(os.getenv("KEYS") or "4")
local n = math.random(0, keys - 1)
request = function()
  n = n + 1
  return wrk.format("GET", "/k" .. (n % keys))
end

-- wrk: requests spread over a few hot keys.
local n = 0
request = function()
  n = n + 1
  return wrk.format("GET", "/k" .. (n % 4))
end

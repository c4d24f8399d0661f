#!/usr/bin/env bash
# RFC 9111 conformance, measured against the field: the HTTP working group's caching
# test suite (npm package `http-cache-tests`, the suite behind cache-tests.fyi) run
# against stampede-sidecar in front of the suite's own origin server. Not run in CI.
#
#   bash benches/conformance.sh            # local cache only, then with a throwaway Redis
#   bash benches/conformance.sh local      # local cache only (no Redis)
#   bash benches/conformance.sh redis      # L1 + a throwaway redis-server
#   GRACE=0s bash benches/conformance.sh local   # the route's grace off (see RESULTS.md)
#   ID=freshness-max-age bash benches/conformance.sh local   # one test, with its exchange
#
# Results (JSON, as the suite's CLI writes them) go to benches/conformance/results/
# (gitignored); the counts are computed by benches/conformance/summarize.mjs with the
# suite's own verdict function (lib/display.mjs `determineTestResult`), dependencies
# honoured, as cache-tests.fyi counts them.
#
# What it runs, as the package documents it (README, package.json "scripts"/"config"):
#   origin: `npm run server --port=N`   = node server/server.mjs with npm_config_port=N
#   client: `npm run --silent cli --base=http://HOST:PORT`
#                                       = node --no-warnings cli.mjs with npm_config_base
# Both are run with `node` directly and those variables set, so that the processes can be
# killed by their own pids (`npm run server` backgrounds itself with `&`) and no npm
# version's handling of unknown `--base`/`--port` flags matters.
set -euo pipefail
cd "$(dirname "$0")/.."
ROOT=$(pwd)
CONF="$ROOT/benches/conformance"
SUITE="$CONF/node_modules/http-cache-tests"
MODES=${1:-both}
case "$MODES" in
  both) MODES="local redis" ;;
  local | redis) ;;
  *) echo "usage: $0 [local|redis|both]" >&2; exit 2 ;;
esac
ID=${ID:-}

command -v node >/dev/null || { echo "node (and npm) are needed: apt-get install nodejs npm" >&2; exit 1; }
if [[ $MODES == *redis* ]] && ! command -v redis-server >/dev/null; then
  echo "installing redis-server"
  apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq redis-server >/dev/null
fi

# 1. The suite, at the version package-lock.json pins (which names no download
#    addresses: npm resolves each name@version from the configured registry and checks
#    the lock's integrity hash).
if [[ ! -f $SUITE/package.json ]] || ! cmp -s "$CONF/package-lock.json" "$CONF/node_modules/.conformance-lock"; then
  (cd "$CONF" && npm ci --no-audit --no-fund --loglevel=error)
  cp "$CONF/package-lock.json" "$CONF/node_modules/.conformance-lock"
fi
VERSION=$(node -p "require('$SUITE/package.json').version")

# 2. The sidecar.
cargo build --release --features sidecar --bin stampede-sidecar 2>&1 | tail -1
SIDECAR="$ROOT/target/release/stampede-sidecar"

work=$(mktemp -d)
pids=()
cleanup() {
  for pid in "${pids[@]}"; do kill "$pid" 2>/dev/null || true; done
  wait 2>/dev/null || true
  rm -rf "$work"
}
trap cleanup EXIT
trap 'exit 130' INT TERM

free_port() { node -e 'const s=require("net").createServer();s.listen(0,"127.0.0.1",()=>{console.log(s.address().port);s.close()})'; }
wait_port() { # port what
  for _ in $(seq 100); do
    if (exec 3<>"/dev/tcp/127.0.0.1/$1") 2>/dev/null; then return; fi
    sleep 0.1
  done
  echo "$2 did not listen on $1" >&2
  exit 1
}

# 3. The suite's origin server (it listens on every interface; only loopback is used).
ORIGIN=$(free_port)
(cd "$work" && npm_config_port="$ORIGIN" npm_config_protocol=http npm_config_pidfile="$work/server.pid" \
  exec node "$SUITE/server/server.mjs") > "$work/origin.log" 2>&1 & pids+=($!)
wait_port "$ORIGIN" "the suite's server"

mkdir -p "$CONF/results"
STAMP=$(date -u +%Y%m%dT%H%M%SZ)

run_mode() { # local|redis
  local mode=$1 port redis_args=() log
  port=$(free_port)
  log="$CONF/results/sidecar-$mode-$STAMP.log"
  if [[ $mode == redis ]]; then
    local rport
    rport=$(free_port)
    redis-server --port "$rport" --bind 127.0.0.1 --save "" --appendonly no --daemonize no \
      --logfile "$work/redis.log" & pids+=($!)
    wait_port "$rport" redis-server
    redis_args=(--redis "redis://127.0.0.1:$rport")
  fi
  # 4. The sidecar as it ships (it follows the origin's Cache-Control by default), with
  #    no route of its own: every request goes through the default policy. --cold-wait
  #    is short (one instance: nobody else fills); the lease bounds an origin call, and
  #    the suite's slowest origin answer is immediate. GRACE (default: the shipped 10s)
  #    is the window an entry is served stale while refreshed when the origin says
  #    nothing about stale.
  local extra=()
  [[ -n ${GRACE:-} ]] && extra+=(--grace "$GRACE")
  STAMPEDE_GUARD_SECRET=conformance-suite-secret "$SIDECAR" --listen "127.0.0.1:$port" \
    --upstream "http://127.0.0.1:$ORIGIN" --cold-wait 250ms --lease 2s \
    "${redis_args[@]}" "${extra[@]}" > "$log" 2>&1 & pids+=($!)
  local sidecar=$!
  wait_port "$port" stampede-sidecar

  # 5. The suite against the sidecar. The base URL takes no trailing slash (the client
  #    appends "/test/...").
  if [[ -n $ID ]]; then
    (cd "$SUITE" && npm_config_base="http://127.0.0.1:$port" npm_config_id="$ID" \
      node --no-warnings cli.mjs)
  else
    local out="$CONF/results/sidecar-$mode-$STAMP.json"
    echo "== $mode: http-cache-tests $VERSION against stampede-sidecar on 127.0.0.1:$port" \
      "(origin 127.0.0.1:$ORIGIN${redis_args:+, ${redis_args[1]}}${GRACE:+, grace $GRACE})"
    (cd "$SUITE" && npm_config_base="http://127.0.0.1:$port" npm_package_config_id="" \
      node --no-warnings cli.mjs) > "$out"
    cp "$out" "$CONF/results/sidecar-$mode-latest.json"
    (cd "$CONF" && node summarize.mjs "$out" --failing)
    echo "results: ${out#"$ROOT"/}"
    echo
  fi
  kill "$sidecar" 2>/dev/null || true
}

for mode in $MODES; do run_mode "$mode"; done
if [[ -z $ID ]]; then
  echo "== for comparison, the results this package ships (same tests, same counting):"
  for impl in trafficserver squid apache varnish nginx fastly; do
    printf '%-14s ' "$impl"
    (cd "$CONF" && node summarize.mjs "$SUITE/results/$impl.json" | tail -1)
  done
fi

#!/usr/bin/env bash
# RFC 9111 conformance, measured against the field: the HTTP working group's caching
# test suite (the suite behind cache-tests.fyi) run against stampede-sidecar in front of
# the suite's own origin server. Not run in CI.
#
#   bash benches/conformance.sh            # local cache only, then with a throwaway Redis
#   bash benches/conformance.sh local      # local cache only (no Redis)
#   bash benches/conformance.sh redis      # L1 + a throwaway redis-server
#   GRACE=10s bash benches/conformance.sh local   # a grace for every entry (see RESULTS.md)
#   ID=freshness-max-age bash benches/conformance.sh local   # one test, with its exchange
#
# Two versions of the suite (SUITES, default "current package": both, in that order):
#
#   current  The suite's repository (github.com/http-tests/cache-tests) at commit
#            b55b8bda3dbb8c927c04e85bd8d496a8caa3e4ba, the one behind the results
#            cache-tests.fyi publishes. Give a copy of it in CACHE_TESTS_DIR (it is only
#            read: it is copied to benches/conformance/cache-tests/, gitignored, and run
#            there); without CACHE_TESTS_DIR, that folder is fetched with git (a clone of
#            the repository, checked out at the pinned commit). Either is done once: the
#            folder is reused while it names the pinned commit. `npm install` there
#            brings its client's dependencies.
#   package  The npm package `http-cache-tests` 0.4.5 (the only version on the npm
#            registry; older tests), pinned by conformance/package-lock.json and
#            installed with `npm ci` (which names no download address: npm resolves each
#            name@version from the configured registry and checks the lock's hashes).
#
# The sidecar: built in release (cargo, honouring CARGO_TARGET_DIR), or the binary named
# by SIDECAR (to measure another commit's build).
#
# Results (JSON, as the suite's CLI writes them) go to benches/conformance/results/
# (gitignored). The counts come from benches/conformance/summarize.mjs, which scores
# with the suite's own verdict function (`determineTestResult`), dependencies honoured,
# as cache-tests.fyi counts: required pass / fail / dependency, optional fail, and each
# required test not passing and each optional one failing, by id and name.
#
# Each suite's origin and client are run with `node` directly, with the variables npm
# would set (npm_config_port, npm_config_base, npm_package_config_id), so that the
# processes can be killed by their own pids and no npm version's flag handling matters.
set -euo pipefail
cd "$(dirname "$0")/.."
ROOT=$(pwd)
CONF="$ROOT/benches/conformance"
PINNED=b55b8bda3dbb8c927c04e85bd8d496a8caa3e4ba
REPOSITORY=https://github.com/http-tests/cache-tests.git
MODES=${1:-both}
case "$MODES" in
  both) MODES="local redis" ;;
  local | redis) ;;
  *) echo "usage: $0 [local|redis|both]" >&2; exit 2 ;;
esac
SUITES=${SUITES:-current package}
for s in $SUITES; do
  case "$s" in current | package) ;; *) echo "SUITES: current and/or package, not $s" >&2; exit 2 ;; esac
done
ID=${ID:-}

command -v node >/dev/null || { echo "node (and npm) are needed: apt-get install nodejs npm" >&2; exit 1; }
if [[ $MODES == *redis* ]] && ! command -v redis-server >/dev/null; then
  echo "installing redis-server"
  apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq redis-server >/dev/null
fi

# 1. The suites.
CURRENT="$CONF/cache-tests"
if [[ $SUITES == *current* && $(cat "$CURRENT/.conformance-commit" 2>/dev/null) != "$PINNED" ]]; then
  rm -rf "$CURRENT"
  if [[ -n ${CACHE_TESTS_DIR:-} ]]; then
    [[ -f $CACHE_TESTS_DIR/test-engine/cli.mjs ]] \
      || { echo "CACHE_TESTS_DIR=$CACHE_TESTS_DIR: no test-engine/cli.mjs there" >&2; exit 1; }
    mkdir -p "$CURRENT"
    cp -R "$CACHE_TESTS_DIR"/. "$CURRENT"/
    chmod -R u+w "$CURRENT"
    rm -rf "$CURRENT/node_modules"
  else
    command -v git >/dev/null || { echo "git is needed to fetch the suite (or set CACHE_TESTS_DIR)" >&2; exit 1; }
    git clone --quiet "$REPOSITORY" "$CURRENT"
    git -C "$CURRENT" -c advice.detachedHead=false checkout --quiet "$PINNED"
  fi
  # Its client's dependencies (undici, for the interim-response tests).
  (cd "$CURRENT" && npm install --omit=dev --no-audit --no-fund --loglevel=error)
  echo "$PINNED" > "$CURRENT/.conformance-commit"
fi
PACKAGE="$CONF/node_modules/http-cache-tests"
if [[ $SUITES == *package* ]]; then
  if [[ ! -f $PACKAGE/package.json ]] || ! cmp -s "$CONF/package-lock.json" "$CONF/node_modules/.conformance-lock"; then
    (cd "$CONF" && npm ci --no-audit --no-fund --loglevel=error)
    cp "$CONF/package-lock.json" "$CONF/node_modules/.conformance-lock"
  fi
fi

# 2. The sidecar.
if [[ -z ${SIDECAR:-} ]]; then
  cargo build --release --features sidecar --bin stampede-sidecar 2>&1 | tail -1
  SIDECAR="${CARGO_TARGET_DIR:-$ROOT/target}/release/stampede-sidecar"
fi
[[ -x $SIDECAR ]] || { echo "no sidecar binary at $SIDECAR" >&2; exit 1; }

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

mkdir -p "$CONF/results"
STAMP=$(date -u +%Y%m%dT%H%M%SZ)

run_suite() { # current|package  local|redis
  local which=$1 mode=$2 dir server cli label port origin redis_args=() log
  if [[ $which == current ]]; then
    dir=$CURRENT server=test-engine/server/server.mjs cli=test-engine/cli.mjs
    label="cache-tests at ${PINNED:0:7}"
  else
    dir=$PACKAGE server=server/server.mjs cli=cli.mjs
    label="http-cache-tests $(node -p "require('$PACKAGE/package.json').version")"
  fi
  # 3. The suite's origin server (it listens on every interface; only loopback is used).
  origin=$(free_port)
  (cd "$work" && npm_config_port="$origin" npm_config_protocol=http npm_config_pidfile="$work/server-$which.pid" \
    exec node "$dir/$server") > "$work/origin-$which.log" 2>&1 & pids+=($!)
  local origin_pid=$!
  wait_port "$origin" "the suite's server"

  port=$(free_port)
  log="$CONF/results/sidecar-$which-$mode-$STAMP.log"
  if [[ $mode == redis ]]; then
    local rport
    rport=$(free_port)
    redis-server --port "$rport" --bind 127.0.0.1 --save "" --appendonly no --daemonize no \
      --logfile "$work/redis.log" & pids+=($!)
    local redis_pid=$!
    wait_port "$rport" redis-server
    redis_args=(--redis "redis://127.0.0.1:$rport")
  fi
  # 4. The sidecar as it ships (it follows the origin's Cache-Control by default), with
  #    no route of its own: every request goes through the default policy. --cold-wait
  #    is short (one instance: nobody else fills); the lease bounds an origin call, and
  #    the suite's slowest origin answer is immediate. GRACE (default: none, as shipped
  #    when following the origin) is a window every entry is served stale while it is
  #    refreshed, when the origin says nothing about stale.
  local extra=()
  [[ -n ${GRACE:-} ]] && extra+=(--grace "$GRACE")
  STAMPEDE_GUARD_SECRET=conformance-suite-secret "$SIDECAR" --listen "127.0.0.1:$port" \
    --upstream "http://127.0.0.1:$origin" --cold-wait 250ms --lease 2s \
    "${redis_args[@]}" "${extra[@]}" > "$log" 2>&1 & pids+=($!)
  local sidecar=$!
  wait_port "$port" stampede-sidecar

  # 5. The suite against the sidecar. The base URL takes no trailing slash (the client
  #    appends "/test/...").
  if [[ -n $ID ]]; then
    (cd "$dir" && npm_config_base="http://127.0.0.1:$port" npm_config_id="$ID" \
      node --no-warnings "$cli")
  else
    local out="$CONF/results/sidecar-$which-$mode-$STAMP.json"
    echo "== $which, $mode: $label against stampede-sidecar on 127.0.0.1:$port" \
      "(origin 127.0.0.1:$origin${redis_args:+, ${redis_args[1]}}${GRACE:+, grace $GRACE})"
    (cd "$dir" && npm_config_base="http://127.0.0.1:$port" npm_package_config_id="" \
      node --no-warnings "$cli") > "$out"
    cp "$out" "$CONF/results/sidecar-$which-$mode-latest.json"
    (cd "$CONF" && node summarize.mjs "$out" --suite "$dir" --failing)
    echo "results: ${out#"$ROOT"/}"
    echo
  fi
  kill "$sidecar" "$origin_pid" ${redis_pid:+"$redis_pid"} 2>/dev/null || true
}

for which in $SUITES; do
  for mode in $MODES; do run_suite "$which" "$mode"; done
done
if [[ -z $ID ]]; then
  for which in $SUITES; do
    if [[ $which == current ]]; then dir=$CURRENT; else dir=$PACKAGE; fi
    echo "== for comparison, the results the $which suite comes with (same tests, same counting):"
    for result in "$dir"/results/*.json; do
      impl=$(basename "$result" .json)
      case "$impl" in chrome | firefox | safari) continue ;; esac # browsers: other tests
      printf '%-14s ' "$impl"
      (cd "$CONF" && node summarize.mjs "$result" --suite "$dir" | tail -1)
    done
  done
fi

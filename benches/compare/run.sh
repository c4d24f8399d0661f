#!/usr/bin/env bash
# The same stampede against nginx (proxy_cache_lock on, proxy_cache_use_stale updating,
# proxy_cache_background_update on; one cache per instance) and against the sidecar
# (the stampede-sidecar binary, one Redis for the fleet), with 1 and 3 instances, on loopback.
# Prints origin calls per key per freshness window, requests/s and p99 side by side.
#
#   bash benches/compare/run.sh            # DURATION=10 CONNECTIONS=50 to change
set -euo pipefail
cd "$(dirname "$0")/../.."
DURATION=${DURATION:-10}
CONNECTIONS=${CONNECTIONS:-48}
KEYS=4
FRESH=1

need() {
  command -v "$1" >/dev/null 2>&1 && return
  echo "installing $2"
  apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq "$2" >/dev/null
}
need nginx nginx-light
need wrk wrk
need redis-server redis-server
cargo build --release --features sidecar --bin stampede-sidecar 2>&1 | tail -1

work=$(mktemp -d)
pids=()
cleanup() {
  for pid in "${pids[@]}"; do kill "$pid" 2>/dev/null || true; done
  wait 2>/dev/null || true
  rm -rf "$work"
}
trap cleanup EXIT

free_port() { python3 -c 'import socket; s=socket.socket(); s.bind(("127.0.0.1",0)); print(s.getsockname()[1])'; }
ORIGIN=$(free_port)
REDIS=$(free_port)
python3 benches/compare/origin.py "$ORIGIN" "$work/calls" & pids+=($!)
redis-server --port "$REDIS" --bind 127.0.0.1 --save "" --appendonly no --daemonize no \
  --logfile "$work/redis.log" & pids+=($!)
sleep 1

start_nginx() { # index port
  local i=$1 port=$2
  mkdir -p "$work/nginx-$i"
  cat > "$work/nginx-$i/nginx.conf" <<CONF
user root;
worker_processes 1;
daemon off;
pid $work/nginx-$i/nginx.pid;
error_log $work/nginx-$i/error.log warn;
events { worker_connections 4096; }
http {
  access_log off;
  proxy_cache_path $work/nginx-$i/cache levels=1:2 keys_zone=c$i:10m max_size=100m inactive=60s use_temp_path=off;
  upstream origin { server 127.0.0.1:$ORIGIN; keepalive 32; }
  server {
    listen 127.0.0.1:$port;
    location / {
      proxy_pass http://origin;
      proxy_http_version 1.1;
      proxy_set_header Connection "";
      proxy_cache c$i;
      proxy_cache_valid 200 ${FRESH}s;
      proxy_cache_lock on;
      proxy_cache_lock_timeout 5s;
      proxy_cache_use_stale updating error timeout;
      proxy_cache_background_update on;
      add_header x-cache \$upstream_cache_status;
    }
  }
}
CONF
  nginx -p "$work/nginx-$i" -c "$work/nginx-$i/nginx.conf" & pids+=($!)
}

start_sidecar() { # index port
  STAMPEDE_GUARD_SECRET=compare-bench-secret-of-16-bytes ./target/release/stampede-sidecar --listen "127.0.0.1:$2" --upstream "http://127.0.0.1:$ORIGIN" \
    --redis "redis://127.0.0.1:$REDIS" --follow-origin false --fresh "${FRESH}s" --grace 30s --lease 2s \
    > "$work/sidecar-$1.log" 2>&1 & pids+=($!)
}

results=()
run() { # name kind instances
  local name=$1 kind=$2 n=$3 ports=() started=()
  for i in $(seq 1 "$n"); do
    local port; port=$(free_port); ports+=("$port")
    local before=${#pids[@]}
    "start_$kind" "$kind-$n-$i" "$port"
    started+=("${pids[$before]}")
  done
  sleep 1.5
  cp "$work/calls" "$work/calls.before" 2>/dev/null || echo 0 > "$work/calls.before"
  local per=$(( CONNECTIONS / n )) outs=() loads=()
  for port in "${ports[@]}"; do
    wrk -t1 -c"$per" -d"${DURATION}s" --latency -s benches/compare/hot-keys.lua \
      "http://127.0.0.1:$port/" > "$work/wrk-$kind-$n-$port.txt" 2>&1 &
    loads+=($!)
    outs+=("$work/wrk-$kind-$n-$port.txt")
  done
  wait "${loads[@]}"
  local calls; calls=$(( $(cat "$work/calls" 2>/dev/null || echo 0) - $(cat "$work/calls.before" 2>/dev/null || echo 0) ))
  local rps; rps=$(cat "${outs[@]}" | awk '/Requests\/sec/ {s += $2} END {printf "%.0f", s}')
  local p99; p99=$(cat "${outs[@]}" | awk '/ 99%/ {print $2}' | sort -h | tail -1)
  local windows=$(( DURATION / FRESH + 1 ))
  local per_key; per_key=$(awk -v c="$calls" -v k="$KEYS" -v w="$windows" 'BEGIN {printf "%.2f", c / (k * w)}')
  results+=("$(printf '%-22s %9s %14s %12s %10s' "$name" "$calls" "$per_key" "$rps" "$p99")")
  for pid in "${started[@]}"; do kill "$pid" 2>/dev/null || true; done
  sleep 0.5
}

run "nginx x1" nginx 1
run "nginx x3" nginx 3
run "sidecar x1" sidecar 1
run "sidecar x3" sidecar 3

echo
echo "$DURATION s, $CONNECTIONS connections, $KEYS hot keys, fresh ${FRESH} s, origin 200 ms"
printf '%-22s %9s %14s %12s %10s\n' "" "origin" "per key/window" "requests/s" "p99"
printf '%s\n' "${results[@]}"

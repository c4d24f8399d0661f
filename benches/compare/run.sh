#!/usr/bin/env bash
# nginx and stampede-sidecar side by side, in one sitting, on loopback: the same wrk load
# against 1, 3 and 8 instances of each, on 4 and 100 hot keys, in front of one origin
# that takes 200 ms per call.
#
# - nginx: proxy_cache_lock on, proxy_cache_use_stale updating, background update,
#   proxy_cache_valid 200 1s, keep-alive to the origin, one cache per instance, access
#   log off.
# - the sidecar: the release binary, --follow-origin false --fresh 1s --grace 10s
#   --lease 2s, every instance on one Redis, with everything a production proxy has
#   on (its timeouts, connection cap, proxy headers), access log off.
# - Each instance gets WORKERS threads (default 1): nginx's worker_processes, the
#   sidecar's --workers.
#
# Prints, for each instance and key count: requests/s, CPU per request (user + system
# time of the proxy processes, wrk and the origin not counted; Redis's apart), origin
# calls per key per freshness window, p99, and the sidecar's ratios to nginx
# (requests/s: higher is better; CPU per request: lower is better).
#
#   bash benches/compare/run.sh
#   DURATION=10 CONNECTIONS=192 INSTANCES="1 3 8" KEY_COUNTS="4 100" WORKERS=1 bash benches/compare/run.sh
#
# Installs nginx and wrk from the distribution's packages when they are missing (as
# root). Not run in CI: it takes about three minutes and both cores.
set -euo pipefail
cd "$(dirname "$0")/../.."
DURATION=${DURATION:-10}
CONNECTIONS=${CONNECTIONS:-192}
INSTANCES=${INSTANCES:-1 3 8}
KEY_COUNTS=${KEY_COUNTS:-4 100}
# Threads per instance, for both: nginx's worker_processes, the sidecar's --workers.
WORKERS=${WORKERS:-1}
FRESH=1
GRACE=10

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
python3 benches/compare/origin.py "$ORIGIN" "$work/calls" 2> "$work/origin.log" & pids+=($!)
redis-server --port "$REDIS" --bind 127.0.0.1 --save "" --appendonly no --daemonize no \
  --logfile "$work/redis.log" & pids+=($!)
REDIS_PID=$!
sleep 1

start_nginx() { # name port
  local dir="$work/$1"
  mkdir -p "$dir"
  cat > "$dir/nginx.conf" <<CONF
user root;
worker_processes $WORKERS;
daemon off;
pid $dir/nginx.pid;
error_log $dir/error.log warn;
events { worker_connections 4096; }
http {
  access_log off;
  proxy_cache_path $dir/cache levels=1:2 keys_zone=c:10m max_size=100m inactive=60s use_temp_path=off;
  upstream origin { server 127.0.0.1:$ORIGIN; keepalive 32; }
  server {
    listen 127.0.0.1:$2;
    location / {
      proxy_pass http://origin;
      proxy_http_version 1.1;
      proxy_set_header Connection "";
      proxy_cache c;
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
  nginx -p "$dir" -c "$dir/nginx.conf" & pids+=($!)
}

start_sidecar() { # name port
  STAMPEDE_GUARD_SECRET=compare-bench-secret-of-16-bytes ./target/release/stampede-sidecar \
    --listen "127.0.0.1:$2" --upstream "http://127.0.0.1:$ORIGIN" \
    --redis "redis://127.0.0.1:$REDIS" --follow-origin false --fresh "${FRESH}s" \
    --grace "${GRACE}s" --lease 2s --workers "$WORKERS" > "$work/$1.log" 2>&1 & pids+=($!)
}

# Clock ticks of user and system time of a process and its children (nginx's worker).
cpu_ticks() {
  local total=0 pid
  for pid in "$@" $(for p in "$@"; do pgrep -P "$p" || true; done); do
    [ -r "/proc/$pid/stat" ] || continue
    total=$(( total + $(awk '{print $14 + $15}' "/proc/$pid/stat") ))
  done
  echo "$total"
}
TICKS=$(getconf CLK_TCK)

declare -A RPS CPU
rows=()
run() { # kind instances keys
  local kind=$1 n=$2 keys=$3 ports=() started=()
  for i in $(seq 1 "$n"); do
    local port; port=$(free_port); ports+=("$port")
    local before=${#pids[@]}
    "start_$kind" "$kind-$n-$keys-$i" "$port"
    started+=("${pids[$before]}")
  done
  sleep 1.5
  # Warm: every key filled once on every instance, all at once (one at a time, 100 keys
  # would take 20 s, and the first would have expired before the load starts).
  local warm=()
  for port in "${ports[@]}"; do
    for k in $(seq 0 $(( keys - 1 ))); do
      curl -s -o /dev/null "http://127.0.0.1:$port/k$k" & warm+=($!)
    done
  done
  wait "${warm[@]}" 2>/dev/null || true
  local calls_before; calls_before=$(cat "$work/calls" 2>/dev/null || echo 0)
  local cpu_before; cpu_before=$(cpu_ticks "${started[@]}")
  local redis_before; redis_before=$(cpu_ticks "$REDIS_PID")
  local per=$(( CONNECTIONS / n )) outs=() loads=()
  for port in "${ports[@]}"; do
    KEYS=$keys wrk -t1 -c"$per" -d"${DURATION}s" --latency -s benches/compare/hot-keys.lua \
      "http://127.0.0.1:$port/" > "$work/wrk-$kind-$n-$keys-$port.txt" 2>&1 &
    loads+=($!)
    outs+=("$work/wrk-$kind-$n-$keys-$port.txt")
  done
  wait "${loads[@]}"
  local cpu; cpu=$(( $(cpu_ticks "${started[@]}") - cpu_before ))
  local redis_cpu; redis_cpu=$(( $(cpu_ticks "$REDIS_PID") - redis_before ))
  local calls; calls=$(( $(cat "$work/calls" 2>/dev/null || echo 0) - calls_before ))
  local requests; requests=$(cat "${outs[@]}" | awk '/requests in/ {s += $1} END {print s + 0}')
  local rps; rps=$(cat "${outs[@]}" | awk '/Requests\/sec/ {s += $2} END {printf "%.0f", s}')
  local p99; p99=$(cat "${outs[@]}" | awk '/ 99%/ {print $2}' | sort -h | tail -1)
  local us; us=$(awk -v c="$cpu" -v t="$TICKS" -v r="$requests" 'BEGIN {printf "%.1f", r ? c / t * 1e6 / r : 0}')
  local redis_us; redis_us=$(awk -v c="$redis_cpu" -v t="$TICKS" -v r="$requests" 'BEGIN {printf "%.2f", r ? c / t * 1e6 / r : 0}')
  local per_key; per_key=$(awk -v c="$calls" -v k="$keys" -v d="$DURATION" -v f="$FRESH" 'BEGIN {printf "%.2f", c / (k * d / f)}')
  RPS[$kind-$n-$keys]=$rps
  CPU[$kind-$n-$keys]=$us
  rows+=("$(printf '%-8s %9s %5s %12s %12s %12s %16s %10s' "$kind" "$n" "$keys" "$rps" "$us" "$redis_us" "$per_key" "$p99")")
  for pid in "${started[@]}"; do kill "$pid" 2>/dev/null || true; done
  wait "${started[@]}" 2>/dev/null || true
  sleep 0.5
}

for keys in $KEY_COUNTS; do
  for n in $INSTANCES; do
    run nginx "$n" "$keys"
    run sidecar "$n" "$keys"
  done
done

echo
echo "$DURATION s per run, $CONNECTIONS connections split over the instances, origin 200 ms, fresh ${FRESH} s"
printf '%-8s %9s %5s %12s %12s %12s %16s %10s\n' "" "instances" "keys" "requests/s" "CPU us/req" "Redis us/req" "origin/key/window" "p99"
printf '%s\n' "${rows[@]}"
echo
echo "sidecar / nginx (requests/s: goal >= 1.3; CPU per request: goal <= 0.25)"
printf '%9s %5s %12s %12s\n' "instances" "keys" "requests/s" "CPU/req"
for keys in $KEY_COUNTS; do
  for n in $INSTANCES; do
    awk -v n="$n" -v k="$keys" -v sr="${RPS[sidecar-$n-$keys]}" -v nr="${RPS[nginx-$n-$keys]}" \
      -v sc="${CPU[sidecar-$n-$keys]}" -v nc="${CPU[nginx-$n-$keys]}" \
      'BEGIN {printf "%9s %5s %11.2fx %11.2fx\n", n, k, nr ? sr / nr : 0, nc ? sc / nc : 0}'
  done
done

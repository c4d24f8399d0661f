#!/usr/bin/env bash
# Large objects: nginx, Varnish and stampede-sidecar side by side, in one sitting, on
# loopback, in front of one origin (large_origin.py) that answers its head after
# 600 ms and its body over about a second, `Cache-Control: max-age=60`.
#
# 1. The stampede: 100 cold readers at once, each on a connection of its own, of an
#    8 MiB answer (crowd.py checks every body's SHA-256): origin calls, bodies whole,
#    time to the first and to the last byte (median, slowest).
# 2. Hits of a 1 MiB and of an 8 MiB entry: wrk with 8 connections for DURATION
#    seconds; requests/s, and CPU per MiB served (user + system time of the proxy's
#    processes: wrk, the origin and Redis not counted).
#
# - nginx: proxy_cache_lock on (its timeout 10 s), proxy_cache_valid from the origin,
#   keep-alive to the origin, access log off.
# - Varnish: its defaults (it streams a fill to its waiting list), 256 MiB of malloc
#   storage, TTL from the origin.
# - the sidecar: the release binary, its defaults (it stores up to 16 MiB, in parts of
#   512 KiB in Redis; L1 of 64 MiB keeps entries of up to 8 MiB), on a Redis of its
#   own, access log off.
#
#   bash benches/compare/large.sh
#   DURATION=10 CROWD=100 bash benches/compare/large.sh
#
# Installs nginx, Varnish and wrk from the distribution's packages when they are missing
# (as root). Not run in CI: it takes about two minutes and both cores.
set -euo pipefail
cd "$(dirname "$0")/../.."
DURATION=${DURATION:-10}
CROWD=${CROWD:-100}

need() {
  command -v "$1" >/dev/null 2>&1 && return
  echo "installing $2"
  apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq "$2" >/dev/null
}
need nginx nginx-light
need varnishd varnish
need wrk wrk
need redis-server redis-server
cargo build --release --features sidecar --bin stampede-sidecar 2>&1 | tail -1

work=$(mktemp -d)
chmod 755 "$work"
pids=()
cleanup() {
  for pid in "${pids[@]}"; do kill "$pid" 2>/dev/null || true; done
  wait 2>/dev/null || true
  rm -rf "$work"
}
trap cleanup EXIT

free_port() { python3 -c 'import socket; s=socket.socket(); s.bind(("127.0.0.1",0)); print(s.getsockname()[1])'; }
ORIGIN=$(free_port)
python3 benches/compare/large_origin.py "$ORIGIN" "$work/calls" 2> "$work/origin.log" & pids+=($!)
sleep 3

start_nginx() { # port; prints the pid
  local dir="$work/nginx"
  mkdir -p "$dir"
  cat > "$dir/nginx.conf" <<CONF
user root;
worker_processes 1;
daemon off;
pid $dir/nginx.pid;
error_log $dir/error.log warn;
events { worker_connections 4096; }
http {
  access_log off;
  proxy_cache_path $dir/cache levels=1:2 keys_zone=c:10m max_size=1g inactive=60s use_temp_path=off;
  upstream origin { server 127.0.0.1:$ORIGIN; keepalive 32; }
  server {
    listen 127.0.0.1:$1;
    location / {
      proxy_pass http://origin;
      proxy_http_version 1.1;
      proxy_set_header Connection "";
      proxy_cache c;
      proxy_cache_lock on;
      proxy_cache_lock_timeout 10s;
      proxy_cache_lock_age 10s;
      add_header x-cache \$upstream_cache_status;
    }
  }
}
CONF
  nginx -p "$dir" -c "$dir/nginx.conf" > /dev/null 2>&1 & pids+=($!)
  echo $!
}

start_varnish() { # port; prints the pid
  local dir="$work/varnish"
  mkdir -p "$dir"
  varnishd -F -j none -n "$dir" -a "127.0.0.1:$1" -b "127.0.0.1:$ORIGIN" \
    -s malloc,256m -p thread_pool_min=50 > "$dir/log" 2>&1 & pids+=($!)
  echo $!
}

start_sidecar() { # port; prints the pid
  local redis; redis=$(free_port)
  redis-server --port "$redis" --bind 127.0.0.1 --save "" --appendonly no --daemonize no \
    --logfile "$work/redis.log" > /dev/null 2>&1 & pids+=($!)
  sleep 0.5
  STAMPEDE_GUARD_SECRET=compare-bench-secret-of-16-bytes ./target/release/stampede-sidecar \
    --listen "127.0.0.1:$1" --upstream "http://127.0.0.1:$ORIGIN" \
    --redis "redis://127.0.0.1:$redis" > "$work/sidecar.log" 2>&1 & pids+=($!)
  echo $!
}

# Clock ticks of user and system time of a process and its children.
cpu_ticks() {
  local total=0 pid
  for pid in "$@" $(for p in "$@"; do pgrep -P "$p" || true; done); do
    [ -r "/proc/$pid/stat" ] || continue
    total=$(( total + $(awk '{print $14 + $15}' "/proc/$pid/stat") ))
  done
  echo "$total"
}
TICKS=$(getconf CLK_TCK)
calls_of() { python3 -c "import json,sys; print(json.load(open('$work/calls')).get(sys.argv[1], 0))" "$1"; }

stampede=()
hits=()
for kind in nginx varnish sidecar; do
  port=$(free_port)
  pid=$("start_$kind" "$port")
  sleep 2
  path="/mib/8/stampede-$kind"
  crowd=$(python3 benches/compare/crowd.py "http://127.0.0.1:$port$path" "$CROWD" 8)
  crowd_calls=$(calls_of "$path")
  # The next 20, one after another.
  for _ in $(seq 20); do curl -s -o /dev/null "http://127.0.0.1:$port$path"; done
  next_calls=$(( $(calls_of "$path") - crowd_calls ))
  stampede+=("$(python3 -c "
import json, sys
c = json.loads(sys.argv[2])
print('%-8s %12s %14s %10s %12s %12s %12s' % (sys.argv[1], sys.argv[3], sys.argv[4],
      '%d/%d' % (c['whole'], c['clients']), c['first_p50'], c['last_p50'], c['last_max']))
" "$kind" "$crowd" "$crowd_calls" "$next_calls")")
  for mib in 1 8; do
    path="/mib/$mib/hit-$kind"
    curl -s -o /dev/null "http://127.0.0.1:$port$path"
    curl -s -o /dev/null "http://127.0.0.1:$port$path"
    before=$(cpu_ticks "$pid")
    out=$(wrk -t1 -c8 -d"${DURATION}s" "http://127.0.0.1:$port$path" 2>&1)
    cpu=$(( $(cpu_ticks "$pid") - before ))
    requests=$(echo "$out" | awk '/requests in/ {print $1}')
    rps=$(echo "$out" | awk '/Requests\/sec/ {printf "%.0f", $2}')
    ms=$(awk -v c="$cpu" -v t="$TICKS" -v r="$requests" -v m="$mib" 'BEGIN {printf "%.2f", r ? c / t * 1e3 / (r * m) : 0}')
    hits+=("$(printf '%-8s %8s %12s %16s %12s' "$kind" "$mib MiB" "$rps" "$ms" "$(calls_of "$path")")")
  done
  kill "$pid" 2>/dev/null || true
  wait "$pid" 2>/dev/null || true
  sleep 1
done

echo
echo "The stampede: $CROWD cold readers of 8 MiB at once (origin: head after 600 ms, body over 1 s)"
printf '%-8s %12s %14s %10s %12s %12s %12s\n' "" "origin calls" "the next 20" "whole" "first p50 s" "last p50 s" "last max s"
printf '%s\n' "${stampede[@]}"
echo
echo "Hits, wrk -c8 for $DURATION s"
printf '%-8s %8s %12s %16s %12s\n' "" "size" "requests/s" "CPU ms per MiB" "origin calls"
printf '%s\n' "${hits[@]}"

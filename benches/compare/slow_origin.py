"""The sidecar in front of an origin slower than its lease, on a cold key.

An origin that takes 3 s per call (counting its calls, and how many are in flight at
once), the stampede-sidecar binary in front of it with `--lease 1s` (so its fills give
up after 1 s) and a Redis of its own, and 200 clients at once on separate connections.
Prints origin calls, the most in flight at once, the answers and the slowest one.

    cargo build --features sidecar --bin stampede-sidecar
    python3 benches/compare/slow_origin.py target/debug/stampede-sidecar
"""
import collections
import http.server
import json
import os
import socket
import socketserver
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request

CLIENTS = 200
ORIGIN_TAKES = 3.0

lock = threading.Lock()
state = {"calls": 0, "in_flight": 0, "peak": 0}


class Origin(http.server.BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"

    def do_GET(self):
        with lock:
            state["calls"] += 1
            state["in_flight"] += 1
            state["peak"] = max(state["peak"], state["in_flight"])
        try:
            time.sleep(ORIGIN_TAKES)
            body = b"slow"
            self.send_response(200)
            self.send_header("content-length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)
        except OSError:
            pass
        finally:
            with lock:
                state["in_flight"] -= 1

    def log_message(self, *args):
        pass


class Server(socketserver.ThreadingMixIn, http.server.HTTPServer):
    daemon_threads = True
    request_queue_size = 1024


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def main(sidecar):
    origin_port, proxy_port, redis_port = free_port(), free_port(), free_port()
    origin = Server(("127.0.0.1", origin_port), Origin)
    threading.Thread(target=origin.serve_forever, daemon=True).start()
    redis = subprocess.Popen(
        ["redis-server", "--port", str(redis_port), "--save", "", "--appendonly", "no"],
        stdout=subprocess.DEVNULL,
    )
    proxy = subprocess.Popen(
        [sidecar, "--listen", f"127.0.0.1:{proxy_port}",
         "--upstream", f"http://127.0.0.1:{origin_port}",
         "--redis", f"redis://127.0.0.1:{redis_port}", "--lease", "1s"],
        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
        env={**os.environ, "STAMPEDE_GUARD_SECRET": "slow-origin-bench-secret-16+"},
    )
    try:
        for _ in range(200):
            try:
                socket.create_connection(("127.0.0.1", proxy_port), timeout=0.2).close()
                break
            except OSError:
                time.sleep(0.1)
        time.sleep(0.5)
        answers = []
        start = threading.Barrier(CLIENTS)

        def client():
            start.wait()
            began = time.time()
            try:
                url = f"http://127.0.0.1:{proxy_port}/hot"
                with urllib.request.urlopen(url, timeout=30) as response:
                    status, x_cache = response.status, response.headers.get("x-cache")
            except urllib.error.HTTPError as error:
                status, x_cache = error.code, error.headers.get("x-cache")
            with lock:
                answers.append((status, x_cache, time.time() - began))

        clients = [threading.Thread(target=client) for _ in range(CLIENTS)]
        for c in clients:
            c.start()
        for c in clients:
            c.join()
        time.sleep(ORIGIN_TAKES + 0.5)
        print(json.dumps({
            "origin_calls": state["calls"],
            "most_in_flight_at_once": state["peak"],
            "answers": dict(collections.Counter(f"{s} x-cache: {x}" for s, x, _ in answers)),
            "slowest_answer_s": round(max(t for *_, t in answers), 2),
        }))
    finally:
        proxy.terminate()
        redis.terminate()


if __name__ == "__main__":
    main(sys.argv[1])

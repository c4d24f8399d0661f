"""The origin of the large-object comparison (benches/compare/large.sh).

GET /mib/<n>/<anything> answers n MiB of bytes that depend only on n (its SHA-256 is
what every client checks), `Cache-Control: max-age=60` and its `Content-Length`: its
head after 600 ms, then its body in 512 KiB writes spread over about a second. Counts
its calls per path, written as JSON to the file it is given after every call.

    python3 benches/compare/large_origin.py PORT CALLS_FILE
"""
import collections
import http.server
import json
import socketserver
import sys
import threading
import time

HEAD_AFTER = 0.6
BODY_TAKES = 1.0
CHUNK = 512 * 1024

lock = threading.Lock()
calls = collections.Counter()
bodies = {}


def body(mib):
    if mib not in bodies:
        bodies[mib] = bytes((i * 7 + i // (1 << 20)) % 251 for i in range(mib << 20))
    return bodies[mib]


class Origin(http.server.BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"

    def do_GET(self):
        parts = self.path.split("/")
        if len(parts) < 3 or parts[1] != "mib" or not parts[2].isdigit():
            self.send_error(404)
            return
        with lock:
            calls[self.path] += 1
            with open(sys.argv[2], "w") as out:
                json.dump(calls, out)
        data = body(int(parts[2]))
        time.sleep(HEAD_AFTER)
        self.send_response(200)
        self.send_header("Content-Type", "application/octet-stream")
        self.send_header("Content-Length", str(len(data)))
        self.send_header("Cache-Control", "max-age=60")
        self.end_headers()
        chunks = range(0, len(data), CHUNK)
        pause = BODY_TAKES / max(1, len(chunks))
        for at in chunks:
            self.wfile.write(data[at : at + CHUNK])
            time.sleep(pause)

    def log_message(self, *args):
        pass


class Server(socketserver.ThreadingMixIn, http.server.HTTPServer):
    daemon_threads = True
    request_queue_size = 1024


if __name__ == "__main__":
    for mib in (1, 8):
        body(mib)
    Server(("127.0.0.1", int(sys.argv[1])), Origin).serve_forever()

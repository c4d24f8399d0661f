"""A slow origin for the comparison: 200 ms per call, counting its calls in a file."""
import http.server
import sys
import threading
import time

port, counter = int(sys.argv[1]), sys.argv[2]
calls = 0
lock = threading.Lock()


class Origin(http.server.BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"

    def do_GET(self):
        global calls
        with lock:
            calls += 1
            with open(counter, "w") as f:
                f.write(str(calls))
        time.sleep(0.2)
        body = f"{self.path} {time.time()}\n".encode()
        self.send_response(200)
        self.send_header("content-type", "text/plain")
        self.send_header("content-length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, *args):
        pass


http.server.ThreadingHTTPServer(("127.0.0.1", port), Origin).serve_forever()

"""A crowd of cold readers (benches/compare/large.sh): N clients at once, each on a
connection of its own, GET one URL; each reads the body whole and checks its SHA-256
against the origin's. Prints JSON: how many got it whole and right, and the time to
the first and to the last byte (median and slowest), in seconds.

    python3 benches/compare/crowd.py URL N MIB
"""
import hashlib
import http.client
import json
import statistics
import sys
import threading
import time
import urllib.parse

url = urllib.parse.urlsplit(sys.argv[1])
clients = int(sys.argv[2])
mib = int(sys.argv[3])
expected = hashlib.sha256(
    bytes((i * 7 + i // (1 << 20)) % 251 for i in range(mib << 20))
).hexdigest()
results = []
lock = threading.Lock()
start = threading.Barrier(clients + 1)


def read():
    conn = http.client.HTTPConnection(url.hostname, url.port, timeout=120)
    conn.connect()
    start.wait()
    began = time.monotonic()
    first = None
    digest = hashlib.sha256()
    try:
        conn.request("GET", url.path)
        response = conn.getresponse()
        while True:
            data = response.read(256 * 1024)
            if not data:
                break
            if first is None:
                first = time.monotonic() - began
            digest.update(data)
        ok = response.status == 200 and digest.hexdigest() == expected
    except Exception:
        ok = False
    with lock:
        results.append((ok, first or 0.0, time.monotonic() - began))


threads = [threading.Thread(target=read) for _ in range(clients)]
for t in threads:
    t.start()
start.wait()
for t in threads:
    t.join()
firsts = [r[1] for r in results if r[0]]
lasts = [r[2] for r in results if r[0]]
print(json.dumps({
    "whole": sum(1 for r in results if r[0]),
    "clients": clients,
    "first_p50": round(statistics.median(firsts), 3) if firsts else None,
    "last_p50": round(statistics.median(lasts), 3) if lasts else None,
    "last_max": round(max(lasts), 3) if lasts else None,
}))

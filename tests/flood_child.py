"""A log-flooding "server" for tests/test_load.py and bench/footprint.py: SGLang's command line, /health 200 at once, a flood on stdout.

Accepts SGLang-style arguments (--model-path, --host, --port; anything else is ignored),
listens on the port and answers GET /health (and anything else) 200 immediately, then writes
FLOOD_RATE numbered lines per second ("seq=N", N from 0) to stdout for FLOOD_S seconds, in
batches every 10 ms, prints "flood done total=N seconds=S at=UNIX_TIME" and keeps serving until SIGTERM.
"""

from __future__ import annotations

import argparse
import http.server
import os
import signal
import sys
import threading
import time


class Health(http.server.BaseHTTPRequestHandler):
    def do_GET(self) -> None:  # noqa: N802
        body = b"ok"
        self.send_response(200)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, *_args: object) -> None:
        pass


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--model-path")
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=30000)
    args, _unknown = p.parse_known_args()
    rate = int(os.environ.get("FLOOD_RATE", "50000"))
    duration = float(os.environ.get("FLOOD_S", "10"))
    delay = float(os.environ.get("FLOOD_DELAY_S", "0.5"))

    server = http.server.ThreadingHTTPServer((args.host, args.port), Health)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    stop = threading.Event()
    signal.signal(signal.SIGTERM, lambda *_: stop.set())

    out = sys.stdout
    out.write("flood child listening; The server is fired up and ready to roll!\n")
    out.flush()
    time.sleep(delay)  # let the supervisor declare ready before the flood
    batch = max(1, rate // 100)  # every 10 ms
    seq = 0
    began = time.monotonic()
    tick = began
    while not stop.is_set() and time.monotonic() - began < duration:
        out.write("".join(f"seq={n}\n" for n in range(seq, seq + batch)))
        out.flush()
        seq += batch
        tick += 0.01
        pause = tick - time.monotonic()
        if pause > 0:
            time.sleep(pause)
    took = time.monotonic() - began
    out.write(f"flood done total={seq} seconds={took:.3f} at={time.time():.3f}\n")
    out.flush()
    stop.wait()
    server.shutdown()


if __name__ == "__main__":
    main()

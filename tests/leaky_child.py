"""A "server" that logs a secret the way SGLang does, for tests/test_hostile_review.py.

SGLang prints its server_args at start, api_key included; this child does the same (the key
is LEAKY_SECRET), then answers every GET 200 on --host:--port. When the file LEAKY_FAIL_FILE
exists at start, it fails instead: an ERROR line that quotes the key, exit 1 (so the restart
asked for after the file was created fails, with the secret in the child's last lines). On
SIGTERM it takes LEAKY_STOP_S seconds to exit 0 (a slow drain: the window in which the
daemon says why it gives up, before it exits).
"""

from __future__ import annotations

import argparse
import http.server
import os
import signal
import sys
import threading
import time


from flood_child import Health as Ok  # the same 200-to-everything server (run from tests/: on sys.path)


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--model-path")
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=30000)
    args, _unknown = p.parse_known_args()
    secret = os.environ.get("LEAKY_SECRET", "sk-secret")
    stamp = time.strftime("[%Y-%m-%d %H:%M:%S]")
    print(f"{stamp} server_args=ServerArgs(model_path={args.model_path!r}, host={args.host!r}, port={args.port}, "
          f"api_key={secret!r}, ...)", flush=True)
    fail = os.environ.get("LEAKY_FAIL_FILE", "")
    if fail and os.path.exists(fail):
        print(f"{stamp} ERROR: rejected the configuration: api_key={secret!r} is not accepted here", flush=True)
        print(f"{stamp} server_args.api_key={secret!r}", flush=True)
        return 1
    server = http.server.ThreadingHTTPServer((args.host, args.port), Ok)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    stop = threading.Event()
    signal.signal(signal.SIGTERM, lambda *_: stop.set())
    print(f"{stamp} The server is fired up and ready to roll!", flush=True)
    stop.wait()
    time.sleep(float(os.environ.get("LEAKY_STOP_S", "0")))
    server.shutdown()
    return 0


if __name__ == "__main__":
    sys.exit(main())

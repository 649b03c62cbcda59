"""Stopping a server that clients still use: straight to the server, or behind a router.

After SIGTERM, SGLang keeps accepting new requests and drains only once none are left (it
looks every 5 s, with no upper bound). Under steady traffic a server that clients reach
directly never drains: the supervisor SIGKILLs it at its stop deadline, cutting what it was
serving. The shipped tp4-512k therefore puts the router in front of its one server: at a stop
the router goes first (closes its listener, finishes what it accepted), then the server drains
at once. This measures both, with CLIENTS clients sending requests of ~REQUEST_S seconds the
whole time, on the stand-in (SGLang's drain and timing) and the real sglang-router:

  * requests accepted and then cut by the stop (a reset, a 5xx other than 503): the number
    that matters; refused connections and 503s are not accepted and are counted apart;
  * how long the stop took (SIGTERM of the first process to everything gone);
  * what the router costs while serving: median latency of the same request straight to the
    server and through the router.

The alternative an operator would pick is the standalone server (the former tp4-512k).
"""

from __future__ import annotations

import asyncio
import os
import statistics
import time
import urllib.request
import json

from common import summary, table, write

from support import CgroupSandbox, RequestLoop, free_ports, make_instance, write_config

RUNS = int(os.environ.get("BENCH_RUNS", "3"))
CLIENTS = 4
TOKEN_S = 0.01
TOKENS = 50  # 0.5 s a request
STOP_TIMEOUT_S = 10.0


def standalone(port: int) -> str:
    return f"""
        [servers.server]
        gpus = [0]
        port = {port}
        model_path = "/m"
        stop_timeout = {STOP_TIMEOUT_S}
        [servers.server.env]
        SUPERVISORD_GPU_STANDIN_TOKEN_S = "{TOKEN_S}"
        """


def behind_router(server: int, router: int, metrics: int) -> str:
    return standalone(server) + f"""
        [router]
        port = {router}
        stop_timeout = {STOP_TIMEOUT_S * 2}
        [router.options]
        policy = "round_robin"
        prometheus-host = "127.0.0.1"
        prometheus-port = {metrics}
        """


def one_stop(tmp, cgroups, with_router: bool) -> dict[str, float]:  # type: ignore[no-untyped-def]
    server, router, metrics = free_ports(3)
    text = behind_router(server, router, metrics) if with_router else standalone(server)
    cdir = write_config(tmp, {"p": text}, cgroups.root, startup=0.5)
    instance, _ = make_instance(cdir, "p")
    front = router if with_router else server

    async def go() -> tuple[RequestLoop, float]:
        await instance.start()
        with RequestLoop(f"http://127.0.0.1:{front}", clients=CLIENTS, tokens=TOKENS) as loop:
            await asyncio.sleep(2.0)
            began = time.monotonic()
            served_before = loop.ok
            await instance.stop()
            took = time.monotonic() - began
            await asyncio.sleep(0.5)
        return loop, took, loop.ok - served_before

    loop, took, during = asyncio.run(go())
    return {"cut": len(loop.lost), "served_during_stop": during, "refused": loop.refused + loop.unavailable,
            "stop_s": took}


def latency(tmp, cgroups, n: int = 60) -> dict[str, float]:  # type: ignore[no-untyped-def]
    server, router, metrics = free_ports(3)
    cdir = write_config(tmp, {"p": behind_router(server, router, metrics).replace(f'"{TOKEN_S}"', '"0"')},
                        cgroups.root, startup=0.5)
    instance, _ = make_instance(cdir, "p")
    body = json.dumps({"text": "hello", "sampling_params": {"max_new_tokens": 8}}).encode()

    def timed(port: int) -> float:
        began = time.perf_counter()
        req = urllib.request.Request(f"http://127.0.0.1:{port}/generate", data=body, headers={"Content-Type": "application/json"})
        with urllib.request.urlopen(req, timeout=10) as r:
            r.read()
        return time.perf_counter() - began

    async def go() -> tuple[list[float], list[float]]:
        await instance.start()
        direct, routed = [], []
        for _ in range(n):  # interleaved, so both see the same machine
            direct.append(await asyncio.to_thread(timed, server))
            routed.append(await asyncio.to_thread(timed, router))
        await instance.stop()
        return direct, routed

    direct, routed = asyncio.run(go())
    return {"direct_ms": statistics.median(direct) * 1000, "routed_ms": statistics.median(routed) * 1000}


def main() -> None:
    import tempfile
    from pathlib import Path

    results: dict[str, list[dict[str, float]]] = {"standalone": [], "behind_router": []}
    lat = {}
    for run in range(RUNS):
        for with_router, key in ((False, "standalone"), (True, "behind_router")):
            cgroups = CgroupSandbox()
            try:
                with tempfile.TemporaryDirectory() as d:
                    results[key].append(one_stop(Path(d), cgroups, with_router))
            finally:
                cgroups.destroy()
    cgroups = CgroupSandbox()
    try:
        with tempfile.TemporaryDirectory() as d:
            lat = latency(Path(d), cgroups)
    finally:
        cgroups.destroy()
    rows = [("profile", "requests cut (median)", "stop took (median)", "served while stopping", "refused (not accepted)")]
    out: dict[str, object] = {"clients": CLIENTS, "request_s": TOKEN_S * TOKENS, "stop_timeout_s": STOP_TIMEOUT_S,
                              "runs": RUNS, "latency": lat}
    for key, runs in results.items():
        cut = summary([r["cut"] for r in runs])
        stop = summary([r["stop_s"] for r in runs])
        out[key] = {"cut": cut, "stop_s": stop, "raw": runs}
        rows.append((key.replace("_", " "), f"{cut['median']:g}", f"{stop['median']:.2f} s",
                     f"{statistics.median(r['served_during_stop'] for r in runs):g}",
                     f"{statistics.median(r['refused'] for r in runs):g}"))
    print(table(rows))
    print(f"router hop: {lat['routed_ms']:.1f} ms median vs {lat['direct_ms']:.1f} ms straight to the server "
          f"(+{lat['routed_ms'] - lat['direct_ms']:.1f} ms)")
    write("stop-under-traffic", out)


if __name__ == "__main__":
    main()

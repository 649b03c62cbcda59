"""A readiness probe: one HTTP GET on the loop, answered by a status code or nothing.

Written on asyncio streams rather than a client library: it must never block the loop, costs
one connection per probe, and needs nothing beyond the status line.
"""

from __future__ import annotations

import asyncio


async def http_status(host: str, port: int, path: str, timeout: float, min_workers: int = 0) -> int | None:
    """The status code of GET http://host:port/path, or None if there was no HTTP answer.

    With `min_workers`, a 200 counts only if the JSON body says at least that many healthy
    workers: sglang-router 0.3.2 answers /readiness 200 as soon as *one* worker is healthy.
    """
    writer = None
    try:
        async with asyncio.timeout(timeout):
            reader, writer = await asyncio.open_connection(host, port)
            hostname = f"[{host}]" if ":" in host else host
            writer.write(f"GET {path} HTTP/1.1\r\nHost: {hostname}:{port}\r\nConnection: close\r\n\r\n".encode())
            await writer.drain()
            status_line = await reader.readline()
            parts = status_line.split()
            if not (len(parts) >= 2 and parts[0].startswith(b"HTTP/") and parts[1].isdigit()):
                return None
            status = int(parts[1])
            if status == 200 and min_workers:
                body = (await reader.read(1 << 16)).split(b"\r\n\r\n", 1)[-1]
                if _healthy_workers(body) < min_workers:
                    return 503
            return status
    except (OSError, asyncio.TimeoutError, ValueError):
        return None
    finally:
        if writer is not None:
            writer.close()


def _healthy_workers(body: bytes) -> int:
    import json

    start = body.find(b"{")
    try:
        return int(json.loads(body[start:]).get("healthy_workers", 0)) if start >= 0 else 0
    except (ValueError, AttributeError, TypeError):
        return 0

"""A readiness probe: one HTTP GET on the loop, answered by a status code or nothing.

Written on asyncio streams rather than a client library: it must never block the loop, costs
one connection per probe, and needs nothing beyond the status line.
"""

from __future__ import annotations

import asyncio


async def http_status(host: str, port: int, path: str, timeout: float) -> int | None:
    """The status code of GET http://host:port/path, or None if there was no HTTP answer."""
    writer = None
    try:
        async with asyncio.timeout(timeout):
            reader, writer = await asyncio.open_connection(host, port)
            hostname = f"[{host}]" if ":" in host else host
            writer.write(f"GET {path} HTTP/1.1\r\nHost: {hostname}:{port}\r\nConnection: close\r\n\r\n".encode())
            await writer.drain()
            status_line = await reader.readline()
        parts = status_line.split()
        if len(parts) >= 2 and parts[0].startswith(b"HTTP/") and parts[1].isdigit():
            return int(parts[1])
        return None
    except (OSError, asyncio.TimeoutError, ValueError):
        return None
    finally:
        if writer is not None:
            writer.close()

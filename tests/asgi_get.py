"""GET a route of the page's app in-process, as raw ASGI (no HTTP client needed), counting the bytes
the response moves: its body and headers, as a browser would receive them."""

from __future__ import annotations

import asyncio
from urllib.parse import urlencode


def asgi_get(app, path: str, query: dict, token: str) -> tuple[int, bytes, int]:
    """(status, body, bytes moved: body plus status line and headers) of GET `path`?`query`."""
    return asyncio.run(_get(app, path, {**query, "token": token}))


def asgi_get_many(app, requests: list[tuple[str, dict]], token: str) -> list[tuple[int, bytes, int]]:
    """asgi_get of each (path, query), one after another in one event loop."""
    async def run():
        return [await _get(app, path, {**query, "token": token}) for path, query in requests]

    return asyncio.run(run())


async def _get(app, path: str, query: dict):
    scope = {"type": "http", "asgi": {"version": "3.0"}, "http_version": "1.1", "method": "GET", "scheme": "http",
             "path": path, "raw_path": path.encode(), "query_string": urlencode(query).encode(), "root_path": "",
             "headers": [(b"host", b"127.0.0.1:8000")], "client": ("127.0.0.1", 5000), "server": ("127.0.0.1", 8000)}
    sent = {"status": None, "body": b"", "head": 0, "asked": False}
    done = asyncio.Event()

    async def receive():
        # the request once; then the client is gone only once the whole response has arrived
        if not sent["asked"]:
            sent["asked"] = True
            return {"type": "http.request", "body": b"", "more_body": False}
        await done.wait()
        return {"type": "http.disconnect"}

    async def send(message):
        if message["type"] == "http.response.start":
            sent["status"] = message["status"]
            sent["head"] = len("HTTP/1.1 200 OK\r\n") + sum(len(k) + len(v) + 4 for k, v in message.get("headers", []))
        elif message["type"] == "http.response.body":
            sent["body"] += message.get("body", b"")
            if not message.get("more_body"):
                done.set()

    await app(scope, receive, send)
    return sent["status"], sent["body"], sent["head"] + len(sent["body"])

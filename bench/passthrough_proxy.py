"""The least a Python HTTP hop can do: an aiohttp server that relays ``POST /v1/completions``
to one upstream and streams the answer back chunk by chunk, with no parsing, checks, metrics
or policy. The benchmarks put it beside our router to show what one hop costs by itself.

    python -m bench.passthrough_proxy PORT UPSTREAM_URL
"""

from __future__ import annotations

import sys

from aiohttp import ClientSession, TCPConnector, web

SESSION = web.AppKey("session", ClientSession)
UPSTREAM = web.AppKey("upstream", str)


async def relay(request: web.Request) -> web.StreamResponse:
    body = await request.read()
    headers = {"content-type": request.headers.get("content-type", "application/json")}
    url = request.app[UPSTREAM] + request.path
    async with request.app[SESSION].post(url, data=body, headers=headers) as upstream:
        content_type = upstream.headers.get("content-type", "application/octet-stream")
        response = web.StreamResponse(
            status=upstream.status, headers={"content-type": content_type}
        )
        await response.prepare(request)
        async for chunk in upstream.content.iter_any():
            await response.write(chunk)
        await response.write_eof()
        return response


async def healthy(_: web.Request) -> web.Response:
    return web.Response(text="ok")


def build(upstream: str) -> web.Application:
    app = web.Application()
    app[UPSTREAM] = upstream.rstrip("/")

    async def open_session(app: web.Application) -> None:
        app[SESSION] = ClientSession(connector=TCPConnector(limit=0))

    async def close_session(app: web.Application) -> None:
        await app[SESSION].close()

    app.on_startup.append(open_session)
    app.on_cleanup.append(close_session)
    app.router.add_post("/v1/completions", relay)
    app.router.add_get("/health", healthy)
    return app


def main() -> int:
    if len(sys.argv) != 3:
        print(__doc__, file=sys.stderr)
        return 2
    web.run_app(build(sys.argv[2]), host="127.0.0.1", port=int(sys.argv[1]), print=None)
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""The relayed decode stream ends its leg even when Starlette never starts the relay: a
client gone by the time the response begins (uvicorn's ``send`` raises, ASGI 2.4) would
otherwise leave the engine connection open and the engine's in-flight count one too high —
which least-in-flight routing reads for every later request. Real Starlette response
objects, driven through the ASGI interface the way uvicorn drives them."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator

import pytest
from starlette.requests import ClientDisconnect

from vllm_hybrid_nixl.router.completions import RelayedStream, RelayProgress

pytestmark = pytest.mark.integration

SCOPE = {"type": "http", "asgi": {"spec_version": "2.4"}}


def relayed(progress: RelayProgress, ended: list[str]) -> RelayedStream:
    async def relay() -> AsyncIterator[bytes]:
        progress.began = True
        try:
            yield b"data: 1\n\n"
            yield b"data: [DONE]\n\n"
        finally:
            ended.append("relay")

    return RelayedStream(relay(), progress, lambda: ended.append("unsent"))


async def never_disconnects() -> dict:
    await asyncio.sleep(3600)
    return {"type": "http.disconnect"}


def test_a_client_gone_before_the_first_byte_still_ends_the_leg() -> None:
    progress, ended = RelayProgress(), []

    async def gone(message: dict) -> None:
        raise OSError("the client closed its connection")  # uvicorn, ASGI 2.4

    with pytest.raises(ClientDisconnect):  # how Starlette reports uvicorn's OSError
        asyncio.run(relayed(progress, ended)(SCOPE, never_disconnects, gone))
    assert not progress.began
    assert ended == ["unsent"]


def test_a_relay_that_ran_ends_its_leg_once_by_itself() -> None:
    progress, ended, sent = RelayProgress(), [], []

    async def send(message: dict) -> None:
        sent.append(message.get("body", b""))

    asyncio.run(relayed(progress, ended)(SCOPE, never_disconnects, send))
    assert progress.began and ended == ["relay"]
    assert b"".join(sent) == b"data: 1\n\ndata: [DONE]\n\n"

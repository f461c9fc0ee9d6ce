"""``limits.within``, the request body's deadline, on both of its ways: a late awaitable
gives the builtin TimeoutError (the handler turns it into a 408), a timely one its result,
and a cancel from outside (the server stopping) propagates as a cancel."""

from __future__ import annotations

import asyncio
import sys

import pytest

from vllm_hybrid_nixl.router.limits import within, within_task, within_wait_for

pytestmark = pytest.mark.unit

WAYS = [within, within_wait_for]
if sys.version_info >= (3, 11):  # asyncio.timeout is 3.11's
    WAYS.append(within_task)


async def late(result: str = "late") -> str:
    await asyncio.sleep(3600)
    return result


async def soon() -> str:
    await asyncio.sleep(0)
    return "soon"


@pytest.mark.parametrize("way", WAYS, ids=lambda f: f.__name__)
def test_a_late_awaitable_times_out_with_the_builtin_timeout_error(way) -> None:
    with pytest.raises(TimeoutError):
        asyncio.run(way(late(), 0.05))


@pytest.mark.parametrize("way", WAYS, ids=lambda f: f.__name__)
def test_a_timely_awaitable_gives_its_result(way) -> None:
    assert asyncio.run(way(soon(), 5.0)) == "soon"


@pytest.mark.parametrize("way", WAYS, ids=lambda f: f.__name__)
def test_a_cancel_from_outside_propagates_as_a_cancel(way) -> None:
    async def cancel_it() -> None:
        task = asyncio.ensure_future(way(late(), 60.0))
        await asyncio.sleep(0.05)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task

    asyncio.run(cancel_it())

"""Watch the router's own event loop: a router starved of CPU or blocked answers late, and
its connect timeouts fire against engines that are fine. The lag goes to /metrics
(``router_event_loop_lag_seconds``) and, past a threshold, to the log."""

from __future__ import annotations

import asyncio
import logging

from prometheus_client import Histogram

logger = logging.getLogger("vllm_hybrid_nixl.router")


async def watch_loop_lag(histogram: Histogram, interval_s: float = 0.25, warn_s: float = 1.0):
    """Sleep ``interval_s`` over and over; how much later than asked the loop woke is lag."""
    loop = asyncio.get_running_loop()
    while True:
        asked = loop.time() + interval_s
        await asyncio.sleep(interval_s)
        lag = max(0.0, loop.time() - asked)
        histogram.observe(lag)
        if lag >= warn_s:
            logger.warning(
                "the router's event loop could not run for %.1f s (CPU starved or blocked); "
                "legs started then may time out against healthy engines. Give the router "
                "CPU of its own (a core, or a process away from the engines)",
                lag,
            )

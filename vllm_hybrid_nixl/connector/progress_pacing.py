"""NIXL's progress thread, paced: between rounds it sleeps in ``poll()`` on its UCX workers'
event descriptors (waking on any transport event, and at least every millisecond) instead of
spinning on a core.

The native NIXL agent takes that pause as ``pthrDelay`` (microseconds; its UCX backend rounds
it up to whole milliseconds for ``poll``), but NIXL's Python agent always builds the native
agent with zero, and zero makes the thread spin: a full core per engine (measured here: one
agent, idle, 1.00 of a core; with a 1 ms delay, 0.02). :func:`paced_agents` hands a delay to
the native agents that a Python agent class creates while it is active.

Why not idle priority instead (``thread_care``): a spinning progress thread at
``SCHED_IDLE`` still takes the UCX worker's lock every round, and when it is preempted
holding it, the engine thread that checks a transfer waits until an idle-priority thread
gets the core again. Measured here, 60 sequential P/D requests: decode TTFT p50 23 ms but up
to 2.1 s, 10 of them over 200 ms; with the thread at normal priority no stalls, but p50 38 ms
(the thread took the engine's core).
"""

from __future__ import annotations

import sys
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

#: The pause to set on vLLM's CPU platform (``progress_poll_us``; see the module docstring).
DEFAULT_POLL_US = 1000

#: ``kv_connector_extra_config`` key: microseconds NIXL's progress thread pauses between rounds.
POLL_KEY = "progress_poll_us"

_lock = threading.RLock()


class _PacedBindings:
    """NIXL's native bindings module, except that agents are built with ``poll_us``."""

    def __init__(self, bindings: Any, poll_us: int) -> None:
        self._bindings, self._poll_us = bindings, poll_us

    def __getattr__(self, name: str) -> Any:
        return getattr(self._bindings, name)

    def nixlAgent(self, name: str, config: Any) -> Any:  # noqa: N802 - NIXL's own name
        config.pthrDelay = self._poll_us
        return self._bindings.nixlAgent(name, config)


def bindings_of(agent_class: type) -> Any | None:
    """The native bindings module ``agent_class`` builds its agents with, when it is NIXL's
    Python agent (``nixl._api.nixl_agent`` or a platform twin) and its native config takes a
    progress delay; else None."""
    module = sys.modules.get(getattr(agent_class, "__module__", ""))
    bindings = getattr(module, "nixlBind", None)
    config_class = getattr(bindings, "nixlAgentConfig", None)
    if config_class is None or not hasattr(bindings, "nixlAgent"):
        return None
    try:
        takes_delay = hasattr(config_class(), "pthrDelay")
    except Exception:  # noqa: BLE001 - an unknown binding: leave it alone
        return None
    return bindings if takes_delay else None


@contextmanager
def paced_agents(agent_class: type | None, poll_us: int) -> Iterator[bool]:
    """While active, agents built by ``agent_class`` get a progress thread that pauses
    ``poll_us`` between rounds. Yields whether it could (False: unknown NIXL, or
    ``poll_us`` 0, NIXL's own spinning thread)."""
    bindings = bindings_of(agent_class) if agent_class is not None and poll_us > 0 else None
    if bindings is None:
        yield False
        return
    module = sys.modules[agent_class.__module__]  # type: ignore[union-attr]
    with _lock:
        module.nixlBind = _PacedBindings(bindings, poll_us)
        try:
            yield True
        finally:
            module.nixlBind = bindings

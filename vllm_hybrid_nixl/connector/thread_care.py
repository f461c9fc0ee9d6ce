"""Idle priority for the busy-polling threads vLLM's NIXL worker starts, without ever
needing to undo it early: for a progress thread that still spins (``progress_poll_us``
unset or 0, or a NIXL whose pause ``progress_pacing`` cannot set).

A spinning NIXL progress thread takes the core its engine computes on (vLLM's CPU build). At
idle priority it polls only when the core is otherwise free, but it can be preempted while it
holds the UCX worker's lock, and the engine thread checking a transfer then waits for it
(measured: decode TTFT stalls of up to 2 s); the paced thread has neither cost. Registering
memory waits on that thread, so it must run at normal priority while the KV caches register:

- where this process may restore normal priority (CAP_SYS_NICE), the threads are idled as
  soon as they are found (engines starting beside each other do not slow each other), set
  back to normal for registration and idled again after it;
- where it may not (Docker's default capabilities, non-root users), they stay at normal
  priority until registration is done and are idled only then, once and for good.

Finding the threads takes a 0.5 s CPU-time sample; it runs in the background, and neither
the worker's constructor nor registration waits for it. Every change and refusal is logged.
"""

from __future__ import annotations

import logging
import threading

from vllm_hybrid_nixl.connector import thread_priority

logger = logging.getLogger("vllm.hybrid_nixl.worker")


class ProgressThreadCare:
    """The busy threads among ``new_threads`` (found in the background) and their priority.

    Registration never waits for the sample: while it runs, a sample that ends leaves the
    threads as they are (normal priority) and ``after_registration`` idles them; a sample
    that ends after registration idles them itself.
    """

    def __init__(self, new_threads: set[int], sample_s: float = 0.5) -> None:
        self.busy: list[int] = []
        self.idle: list[int] = []
        self.can_undo = thread_priority.can_undo_idle()
        self._lock = threading.Lock()
        self._registering = False
        self._registered = False
        self._sampler = threading.Thread(
            target=self._find_and_idle,
            args=(new_threads, sample_s),
            name="hybrid-nixl-threads",
            daemon=True,
        )
        self._sampler.start()

    def _find_and_idle(self, new_threads: set[int], sample_s: float) -> None:
        busy = thread_priority.busy_threads(new_threads, sample_s=sample_s)
        with self._lock:
            self.busy = busy
            if not busy or self._registering:
                return  # nothing to do, or after_registration idles them
            if self._registered:
                self._idle_for_good("after registration")
            elif self.can_undo:
                self.idle = thread_priority.make_idle(busy)
                logger.info(
                    "vllm-hybrid-nixl: %d busy-polling NIXL thread(s) %s now at idle priority",
                    len(self.idle),
                    self.idle,
                )
            else:
                logger.info(
                    "vllm-hybrid-nixl: busy-polling NIXL thread(s) %s stay at normal priority "
                    "until the KV caches are registered: this process cannot restore normal "
                    "priority (no CAP_SYS_NICE), and registration waits on them",
                    busy,
                )

    def before_registration(self) -> None:
        """Normal priority for registration (threads idled by the sample come back)."""
        with self._lock:
            self._registering = True
            if self.idle:
                restored = thread_priority.make_normal(self.idle)
                if restored != self.idle:
                    logger.warning(
                        "vllm-hybrid-nixl: could not restore normal priority of NIXL thread(s) "
                        "%s for registration; it may be slow",
                        sorted(set(self.idle) - set(restored)),
                    )

    def after_registration(self) -> None:
        """Idle priority from now on (now, or when the sample ends)."""
        with self._lock:
            self._registering = False
            self._registered = True
            if self.busy:
                self._idle_for_good("after registration")

    def wait_for_sample(self, timeout_s: float | None = None) -> bool:
        """Block until the background sample has ended; True if it has."""
        self._sampler.join(timeout_s)
        return not self._sampler.is_alive()

    def _idle_for_good(self, when: str) -> None:
        self.idle = thread_priority.make_idle(self.busy)
        logger.info(
            "vllm-hybrid-nixl: NIXL thread(s) %s at idle priority %s%s",
            self.idle,
            when,
            "" if self.idle == self.busy else f" (not: {sorted(set(self.busy) - set(self.idle))})",
        )

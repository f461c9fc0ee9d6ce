"""Prometheus metrics of the router (its own registry, so several routers can live in one
process, e.g. in tests)."""

from __future__ import annotations

from typing import Any

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram
from prometheus_client.metrics import MetricWrapperBase


class RouterMetrics:
    """The router's metrics. Per-request code takes labelled children through
    :meth:`child`, which looks each one up once (``labels()`` validates and locks on every
    call, and a streamed request touches seven)."""

    def __init__(self) -> None:
        self._children: dict[tuple[int, tuple[str, ...]], Any] = {}
        self.registry = CollectorRegistry()
        self.requests = Counter(
            "router_requests",
            "Requests received, by endpoint and outcome",
            ["endpoint", "outcome"],
            registry=self.registry,
        )
        self.leg_requests = Counter(
            "router_leg_requests",
            "Legs sent to engines, by leg, engine and outcome",
            ["leg", "engine", "outcome"],
            registry=self.registry,
        )
        self.leg_seconds = Histogram(
            "router_leg_seconds",
            "Time from sending a leg to its response headers",
            ["leg"],
            registry=self.registry,
        )
        self.request_seconds = Histogram(
            "router_request_seconds",
            "End-to-end time of a request through the router",
            ["endpoint"],
            registry=self.registry,
        )
        self.in_flight = Gauge(
            "router_in_flight_requests", "Requests being served", registry=self.registry
        )
        self.engine_up = Gauge(
            "router_engine_up",
            "1 when the engine takes legs (probes pass, breaker closed), else 0",
            ["engine", "role"],
            registry=self.registry,
        )
        self.engine_in_flight = Gauge(
            "router_engine_in_flight_legs",
            "Legs in flight on each engine",
            ["engine"],
            registry=self.registry,
        )
        self.policy_choices = Counter(
            "router_policy_choices_total",
            "Legs placed by the routing policy, by why the engine was chosen",
            ["role", "reason", "engine"],
            registry=self.registry,
        )
        self.retries = Counter(
            "router_retries",
            "Legs sent again elsewhere (prefill, decode) and whole requests run again (request)",
            ["leg"],
            registry=self.registry,
        )
        self.client_disconnects = Counter(
            "router_client_disconnects",
            "Requests whose client went away before the answer; their legs were aborted",
            registry=self.registry,
        )
        self.lease_reruns = Counter(
            "router_lease_reruns",
            "Whole requests run again because the decode engine refused the prefill's KV: "
            "the prefill engine had released the blocks (lease expired, engine restarted)",
            registry=self.registry,
        )
        self.loop_lag = Histogram(
            "router_event_loop_lag_seconds",
            "How late the router's event loop woke from a timed sleep: time it could not "
            "serve (starved of CPU or blocked)",
            buckets=(0.005, 0.01, 0.05, 0.1, 0.5, 1.0, 2.0, 5.0, 10.0, 30.0),
            registry=self.registry,
        )

    def child(self, metric: MetricWrapperBase, *values: str) -> Any:
        """``metric.labels(*values)``, cached: label sets are bounded (engines, legs,
        outcomes, reasons), and no child is ever removed from these metrics."""
        key = (id(metric), values)
        found = self._children.get(key)
        if found is None:
            found = self._children[key] = metric.labels(*values)
        return found

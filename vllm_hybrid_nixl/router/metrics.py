"""Prometheus metrics of the router (its own registry, so several routers can live in one
process, e.g. in tests)."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram


class RouterMetrics:
    def __init__(self) -> None:
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

"""Read numbers out of a ``/metrics`` page (Prometheus text, as vLLM and the router serve it)."""

from __future__ import annotations

import httpx
from prometheus_client.parser import text_string_to_metric_families


def sample_values(text: str, sample: str, **labels: str) -> list[float]:
    """The values of the samples named ``sample`` (a counter's with its ``_total``) whose
    labels include ``labels``, one per label set."""
    return [
        found.value
        for family in text_string_to_metric_families(text)
        for found in family.samples
        if found.name == sample and labels.items() <= found.labels.items()
    ]


def sample_sum(text: str, sample: str, **labels: str) -> float:
    """The sum of :func:`sample_values`; 0 when there is none yet."""
    return sum(sample_values(text, sample, **labels))


def read_metrics(url: str, client: httpx.Client | None = None, timeout_s: float = 30.0) -> str:
    """``url``'s ``/metrics`` page (``url`` is the server's base URL)."""
    response = (client or httpx).get(f"{url}/metrics", timeout=timeout_s)
    response.raise_for_status()
    return response.text

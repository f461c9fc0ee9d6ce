"""What ``bench.goodput`` computes from its samples: SLO attainment, goodput and the crossover
rate between two ways of serving, quantiles read from an engine's own Prometheus histogram,
and the model's compute per byte of KV beside a real model's. Pure functions, no I/O."""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

#: Attainment a way must reach at a rate for that rate to count as its goodput (DistServe's 90%).
ATTAINMENT_GOAL = 0.9


@dataclass(frozen=True)
class Sample:
    """One request of an arrival stream, as its client saw it; None for a request that did
    not finish (an error, or still running at the run's end)."""

    ttft_s: float | None
    tpot_s: float | None = None  # (last token - first token) / (output tokens - 1)
    max_gap_s: float | None = None  # the longest wait between two streamed tokens

    @property
    def finished(self) -> bool:
        return self.ttft_s is not None and self.max_gap_s is not None

    def meets(self, ttft_slo_s: float, gap_slo_s: float) -> bool:
        """First token within ``ttft_slo_s`` and no wait between tokens over ``gap_slo_s``
        (a stall a reader of the stream sees, e.g. while another prompt prefills)."""
        return (
            self.ttft_s is not None
            and self.max_gap_s is not None
            and self.ttft_s <= ttft_slo_s
            and self.max_gap_s <= gap_slo_s
        )


def attainment(samples: Sequence[Sample], ttft_slo_s: float, gap_slo_s: float) -> float:
    """Share of requests that finished within both SLOs (unfinished ones miss)."""
    if not samples:
        return math.nan
    return sum(s.meets(ttft_slo_s, gap_slo_s) for s in samples) / len(samples)


def mean_delta(before: tuple[float, float], after: tuple[float, float]) -> float:
    """Mean of a histogram's observations between two scrapes of its (sum, count)."""
    count = after[1] - before[1]
    return (after[0] - before[0]) / count if count > 0 else math.nan


def goodput_rate(points: Sequence[tuple[float, float]], goal: float = ATTAINMENT_GOAL) -> float:
    """The highest rate of ``(rate, attainment)`` points, rates rising, up to which every
    point meets ``goal``; 0.0 when even the lowest misses it. At the edges it bounds the
    true goodput: the highest rate measured means at least that, 0.0 means below the
    lowest."""
    best = 0.0
    for rate, share in sorted(points):
        if not share >= goal:
            break
        best = rate
    return best


def crossover_rate(
    rates: Sequence[float], ours: Sequence[float], theirs: Sequence[float]
) -> float | None:
    """The rate where ``ours - theirs`` (e.g. P/D's attainment minus colocated's) changes
    from one strict sign to the other, interpolated linearly between the two measured rates
    around it (ties and NaN skipped); None when it never does. Only the first change is
    given; which way the lead went is the sign of ``ours - theirs`` at the lowest rate."""
    diffs = [a - b for a, b in zip(ours, theirs, strict=True)]
    pairs = sorted(zip(rates, diffs, strict=True))
    signed = [(r, d) for r, d in pairs if d != 0 and not math.isnan(d)]
    for (r0, d0), (r1, d1) in zip(signed, signed[1:], strict=False):
        if (d0 < 0) != (d1 < 0):
            return r0 + (r1 - r0) * d0 / (d0 - d1)
    return None


def histogram_delta(
    before: Mapping[float, float], after: Mapping[float, float]
) -> dict[float, float]:
    """Cumulative bucket counts (upper bound -> count, ``+Inf`` included) added between two
    scrapes of one histogram."""
    return {bound: after[bound] - before.get(bound, 0.0) for bound in after}


def histogram_quantile(buckets: Mapping[float, float], q: float) -> float:
    """The ``q`` quantile (0-1) of cumulative ``buckets``, linear inside the bucket it falls
    in (as Prometheus' ``histogram_quantile``); NaN without observations. A quantile in the
    ``+Inf`` bucket is the highest finite bound."""
    bounds = sorted(buckets)
    total = buckets[bounds[-1]] if bounds else 0.0
    if total <= 0:
        return math.nan
    rank = q * total
    lower_bound, lower_count = 0.0, 0.0
    for bound in bounds:
        count = buckets[bound]
        if count >= rank:
            if math.isinf(bound):
                return lower_bound
            inside = count - lower_count
            share = (rank - lower_count) / inside if inside > 0 else 1.0
            return lower_bound + (bound - lower_bound) * share
        lower_bound, lower_count = bound, count
    return lower_bound


def summed_buckets(per_engine: Iterable[Mapping[float, float]]) -> dict[float, float]:
    """One histogram's cumulative buckets added over engines (same bounds on each)."""
    total: dict[float, float] = {}
    for buckets in per_engine:
        for bound, count in buckets.items():
            total[bound] = total.get(bound, 0.0) + count
    return total


@dataclass(frozen=True)
class Shape:
    """The per-layer shape that sets a dense transformer's compute and KV per token."""

    hidden: int
    heads: int
    kv_heads: int
    head_dim: int
    intermediate: int
    kv_bytes_per_value: int = 2  # bf16

    @property
    def flops_per_token(self) -> float:
        """Matmul FLOPs per token of one layer (2 per weight: q, k, v, o and a gated MLP);
        attention's score FLOPs, which grow with context, left out."""
        q_o = 2 * self.hidden * self.heads * self.head_dim
        k_v = 2 * self.hidden * self.kv_heads * self.head_dim
        mlp = 3 * self.hidden * self.intermediate
        return 2.0 * (q_o + k_v + mlp)

    @property
    def kv_bytes_per_token(self) -> int:
        """KV bytes one token adds to one attention layer (keys and values)."""
        return 2 * self.kv_heads * self.head_dim * self.kv_bytes_per_value

    @property
    def flops_per_kv_byte(self) -> float:
        return self.flops_per_token / self.kv_bytes_per_token

    def summary(self) -> dict[str, Any]:
        return {
            **self.__dict__,
            "flops_per_token_per_layer": self.flops_per_token,
            "kv_bytes_per_token_per_layer": self.kv_bytes_per_token,
            "flops_per_kv_byte": round(self.flops_per_kv_byte),
        }


#: Llama-3-8B's layer (hidden 4096, 32 query heads, 8 KV heads of 128, MLP 14336): a real
#: GQA model to compare the bench model's compute per byte of KV with.
LLAMA3_8B = Shape(hidden=4096, heads=32, kv_heads=8, head_dim=128, intermediate=14336)

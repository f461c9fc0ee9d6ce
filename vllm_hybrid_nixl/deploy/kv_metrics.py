"""Read the decode engine's evidence that KV arrived over NIXL from its ``/metrics``."""

from __future__ import annotations

from dataclasses import dataclass

import httpx

from vllm_hybrid_nixl.deploy.metrics_text import read_metrics, sample_sum


@dataclass(frozen=True)
class KvTransferCounters:
    external_prompt_tokens: float  # prompt tokens whose KV came from a remote engine
    nixl_bytes: float  # bytes NIXL moved into this engine
    failed_transfers: float
    # seconds its reads took, each from its post until the engine's step saw it done
    nixl_xfer_s: float = 0.0

    def __sub__(self, other: KvTransferCounters) -> KvTransferCounters:
        return KvTransferCounters(
            self.external_prompt_tokens - other.external_prompt_tokens,
            self.nixl_bytes - other.nixl_bytes,
            self.failed_transfers - other.failed_transfers,
            self.nixl_xfer_s - other.nixl_xfer_s,
        )


def read_kv_transfer_counters(
    engine_url: str, client: httpx.Client | None = None
) -> KvTransferCounters:
    """Sum vLLM's KV-transfer counters over all label sets of one engine."""
    text = read_metrics(engine_url, client, timeout_s=10.0)
    return KvTransferCounters(
        sample_sum(text, "vllm:prompt_tokens_by_source_total", source="external_kv_transfer"),
        sample_sum(text, "vllm:nixl_bytes_transferred_sum"),
        sample_sum(text, "vllm:nixl_num_failed_transfers_total"),
        sample_sum(text, "vllm:nixl_xfer_time_seconds_sum"),
    )

"""Read the decode engine's evidence that KV arrived over NIXL from its ``/metrics``."""

from __future__ import annotations

from dataclasses import dataclass

import httpx
from prometheus_client.parser import text_string_to_metric_families


@dataclass(frozen=True)
class KvTransferCounters:
    external_prompt_tokens: float  # prompt tokens whose KV came from a remote engine
    nixl_bytes: float  # bytes NIXL moved into this engine
    failed_transfers: float

    def __sub__(self, other: KvTransferCounters) -> KvTransferCounters:
        return KvTransferCounters(
            self.external_prompt_tokens - other.external_prompt_tokens,
            self.nixl_bytes - other.nixl_bytes,
            self.failed_transfers - other.failed_transfers,
        )


def read_kv_transfer_counters(
    engine_url: str, client: httpx.Client | None = None
) -> KvTransferCounters:
    """Sum vLLM's KV-transfer counters over all label sets of one engine."""
    text = (client or httpx).get(f"{engine_url}/metrics", timeout=10.0).text
    external = nixl_bytes = failed = 0.0
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if (
                sample.name == "vllm:prompt_tokens_by_source_total"
                and sample.labels.get("source") == "external_kv_transfer"
            ):
                external += sample.value
            elif sample.name == "vllm:nixl_bytes_transferred_sum":
                nixl_bytes += sample.value
            elif sample.name == "vllm:nixl_num_failed_transfers_total":
                failed += sample.value
    return KvTransferCounters(external, nixl_bytes, failed)

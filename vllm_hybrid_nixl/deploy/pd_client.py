"""One disaggregated completion: the prefill leg on P, then the decode leg on D.

The full router (several engines, streaming, health) lives in ``vllm_hybrid_nixl.router``;
this is the two-leg protocol itself for one client (demo, benchmarks, tests). The prefill
leg is the router's own (``router.proxy.prefill_body``), so both speak one protocol.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import httpx

from vllm_hybrid_nixl.router.proxy import leg_request_id, prefill_body

__all__ = ["DisaggregatedResult", "LegError", "disaggregated_completion", "prefill_body"]


class LegError(RuntimeError):
    """One leg of a disaggregated request failed; names the leg and the engine."""


@dataclass(frozen=True)
class DisaggregatedResult:
    prefill_response: dict[str, Any]
    decode_response: dict[str, Any]

    @property
    def text(self) -> str:
        return self.decode_response["choices"][0]["text"]


def _post(client: httpx.Client, leg: str, url: str, body: dict[str, Any]) -> dict[str, Any]:
    try:
        response = client.post(f"{url}/v1/completions", json=body)
    except httpx.HTTPError as exc:
        raise LegError(f"{leg} leg: engine {url} did not answer: {exc}") from exc
    if response.status_code != 200:
        raise LegError(
            f"{leg} leg: engine {url} answered HTTP {response.status_code}: {response.text[:500]}"
        )
    return response.json()


def disaggregated_completion(
    client: httpx.Client, prefill_url: str, decode_url: str, body: dict[str, Any]
) -> DisaggregatedResult:
    """Prefill on ``prefill_url`` (1 token, KV kept), then decode on ``decode_url`` with that KV."""
    body = {**body, "request_id": leg_request_id()}  # one id for both legs (push pairs by it)
    prefill = _post(client, "prefill", prefill_url, prefill_body(body))
    params = prefill.get("kv_transfer_params")
    if not params:
        raise LegError(
            f"prefill leg: engine {prefill_url} returned no kv_transfer_params; is it "
            "running with --kv-transfer-config and kv_role kv_producer?"
        )
    decode = _post(client, "decode", decode_url, {**body, "kv_transfer_params": params})
    return DisaggregatedResult(prefill_response=prefill, decode_response=decode)

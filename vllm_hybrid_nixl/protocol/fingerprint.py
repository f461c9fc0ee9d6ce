"""The KV-cache layout fingerprint two engines compare before any KV moves.

Plain data, no vLLM import: the worker, the ``check`` command and the router all build,
encode, decode and compare fingerprints with this module.

On the wire the fingerprint replaces vLLM's NIXL compatibility hash with::

    hybrid-nixl/<protocol>:<sha256 of the canonical JSON>:<base64(zlib(JSON))>

so equal layouts give equal strings (vLLM's own string comparison still holds), a stock
``NixlConnector`` peer is recognised by its plain hex digest, and a mismatch can be
explained field by field from the readable part.
"""

from __future__ import annotations

import base64
import hashlib
import json
import zlib
from dataclasses import asdict, dataclass, field
from typing import Any

from pydantic import TypeAdapter

from vllm_hybrid_nixl.protocol.tp_split import PER_RANK_GROUP_FIELDS, split_problems

PROTOCOL_VERSION = 1
WIRE_PREFIX = "hybrid-nixl/"

#: Which way each field is usually fixed, for the hint at the end of a mismatch message.
FIELD_HINTS = {
    "block_size": "start both engines with the same --block-size",
    "kernel_block_size": "use the same attention backend (VLLM_ATTENTION_BACKEND) on both engines",
    "ratio": "use the same attention backend (VLLM_ATTENTION_BACKEND) on both engines",
    "model": "serve the same model (same path or name) on both engines",
    "dtype": "start both engines with the same --dtype",
    "cache_dtype": "start both engines with the same --kv-cache-dtype",
    "num_hidden_layers": "serve the same model on both engines",
    "num_kv_heads": "serve the same model on both engines",
    "head_size": "serve the same model on both engines",
    "tensor_parallel_size": "start both engines with the same --tensor-parallel-size",
    "kv_layout": "use the same attention backend (VLLM_ATTENTION_BACKEND) on both engines",
    "attn_backend": "use the same attention backend (VLLM_ATTENTION_BACKEND) on both engines",
    "transfer_mode": "run HybridNixlConnector (pull) or HybridNixlPushConnector on both sides",
    "vllm_version": "install the same vLLM release on both engines",
    "protocol": "install the same vllm-hybrid-nixl release on both engines",
    "hybrid_kv_cache_manager": "set --disable-hybrid-kv-cache-manager the same on both engines",
    "num_groups": "serve the same model with the same hybrid allocator settings on both engines",
    "state": "give both engines the same VLLM_SSM_CONV_STATE_LAYOUT (DS), --mamba-ssm-cache-dtype "
    "and --mamba-cache-dtype",
}


class LayoutMismatchError(RuntimeError):
    """Two engines' KV-cache layouts differ, so transferring KV between them would corrupt it."""


class StockPeerError(RuntimeError):
    """The peer runs vLLM's stock NixlConnector, which does not check hybrid layouts."""


@dataclass(frozen=True)
class GroupFingerprint:
    """One KV-cache group as the hybrid allocator laid it out."""

    kind: str  # full_attention, sliding_window, mamba, ...
    num_layers: int
    block_size: int  # tokens per logical block (the user's block size for attention)
    kernel_block_size: int  # tokens per physical block the attention kernel uses
    ratio: int  # physical blocks per logical block (r)
    page_bytes: int  # bytes of one logical block of one layer
    sliding_window: int | None
    dtype: str
    #: Mamba / linear-attention groups: the kind of state and each state tensor's shape and
    #: dtype ("mamba2 (8,4,32)+(8,16,32) float32+float32"). The shapes follow the conv-state
    #: layout (VLLM_SSM_CONV_STATE_LAYOUT) and the dtypes --mamba-ssm-cache-dtype /
    #: --mamba-cache-dtype, so engines that differ there differ here.
    state: str = ""


@dataclass(frozen=True)
class LayoutFingerprint:
    """Everything that must be equal on both sides for KV blocks to mean the same thing."""

    vllm_version: str
    transfer_mode: str
    model: str
    dtype: str
    cache_dtype: str
    num_hidden_layers: int
    num_kv_heads: int
    head_size: int
    tensor_parallel_size: int
    kv_layout: str
    attn_backend: str
    hybrid_kv_cache_manager: bool
    groups: tuple[GroupFingerprint, ...]
    #: vLLM's own compatibility hash (covers what vLLM itself checks, e.g. speculative config).
    vllm_compat_hash: str = ""
    protocol: int = PROTOCOL_VERSION

    # ---- derived -----------------------------------------------------------------------
    @property
    def is_hybrid(self) -> bool:
        return len(self.groups) > 1

    @property
    def block_size(self) -> int:
        """The user block size (of the first attention group)."""
        return self.groups[0].block_size if self.groups else 0

    def fields(self) -> dict[str, Any]:
        """Flat ``name -> value``; group fields are named ``groups[i].field``."""
        flat: dict[str, Any] = {}
        for name, value in asdict(self).items():
            if name == "groups":
                continue
            flat[name] = value
        flat["num_groups"] = len(self.groups)
        for index, group in enumerate(self.groups):
            for name, value in asdict(group).items():
                flat[f"groups[{index}].{name}"] = value
        return flat

    def canonical_json(self) -> str:
        return json.dumps(asdict(self), sort_keys=True, separators=(",", ":"))

    def digest(self) -> str:
        return hashlib.sha256(self.canonical_json().encode()).hexdigest()

    # ---- wire form ---------------------------------------------------------------------
    def encode(self) -> str:
        """The string that stands in for vLLM's compatibility hash in the NIXL handshake."""
        packed = base64.urlsafe_b64encode(zlib.compress(self.canonical_json().encode(), 9))
        return f"{WIRE_PREFIX}{self.protocol}:{self.digest()}:{packed.decode()}"


@dataclass(frozen=True)
class Difference:
    field: str
    local: Any
    remote: Any
    #: What to change, where the field's usual hint does not say it.
    hint: str = ""
    #: Found by the per-rank rule for hybrid pairs of different TP sizes.
    per_rank: bool = False


@dataclass
class PeerVerdict:
    """Outcome of comparing a peer's handshake string with our fingerprint."""

    compatible: bool
    stock_peer: bool = False
    differences: list[Difference] = field(default_factory=list)
    remote: LayoutFingerprint | None = None


def is_ours(wire: str) -> bool:
    return wire.startswith(WIRE_PREFIX)


_WIRE_SCHEMA = TypeAdapter(LayoutFingerprint)


def decode(wire: str) -> LayoutFingerprint:
    """Parse a handshake string written by :meth:`LayoutFingerprint.encode`; every field must
    have its declared type (strict: no "2" for 2), so comparisons never meet a wrong type."""
    try:
        prefix, digest, packed = wire.split(":", 2)
        raw = zlib.decompress(base64.urlsafe_b64decode(packed.encode()))
        fingerprint = _WIRE_SCHEMA.validate_json(raw, strict=True)
    except (ValueError, TypeError, zlib.error) as exc:
        raise ValueError(f"not a vllm-hybrid-nixl layout fingerprint: {wire[:80]!r}") from exc
    if fingerprint.digest() != digest:
        raise ValueError("layout fingerprint digest does not match its content")
    return fingerprint


def differences(
    local: LayoutFingerprint, remote: LayoutFingerprint, local_role: str = "decode"
) -> list[Difference]:
    """Fields whose values differ, in a stable order (scalars first, then groups).

    Plain models carry no TP size (vLLM's NIXL maps their KV heads across ranks). Hybrid
    models of different TP sizes are compared by :mod:`~vllm_hybrid_nixl.protocol.tp_split`
    for their per-rank facts, and field by field for everything else; ``local_role``
    (``"decode"`` or ``"prefill"``) tells that rule which side is which."""
    mine, theirs = local.fields(), remote.fields()
    names = list(mine) + [name for name in theirs if name not in mine]
    found = [
        Difference(name, mine.get(name), theirs.get(name))
        for name in names
        if mine.get(name) != theirs.get(name)
    ]
    # vLLM's hash differs whenever a readable field does; name it only when it is the sole
    # difference (then it is a factor vLLM hashes that we do not spell out).
    if len(found) > 1:
        found = [item for item in found if item.field != "vllm_compat_hash"]
    if not (local.is_hybrid and remote.is_hybrid):
        # single-group layouts carry TP 0; against a hybrid, the group fields say what differs
        return [item for item in found if item.field != "tensor_parallel_size"]
    if local.tensor_parallel_size == remote.tensor_parallel_size:
        return found
    per_rank = {"tensor_parallel_size"} | {
        f"groups[{index}].{name}"
        for index in range(max(len(local.groups), len(remote.groups)))
        for name in PER_RANK_GROUP_FIELDS
    }
    found = [item for item in found if item.field not in per_rank]
    problems = split_problems(
        local.tensor_parallel_size,
        remote.tensor_parallel_size,
        local_role=local_role,
        transfer_mode=local.transfer_mode,
        kv_heads=local.num_kv_heads,
        local_groups=[asdict(group) for group in local.groups],
        remote_groups=[asdict(group) for group in remote.groups],
    )
    return [
        *(Difference(p.field, p.local, p.remote, p.hint, per_rank=True) for p in problems),
        *found,
    ]


def compare_with_peer(
    local: LayoutFingerprint, remote_wire: str, local_role: str = "decode"
) -> PeerVerdict:
    """Compare our fingerprint with the string a peer sent as its compatibility hash."""
    if not is_ours(remote_wire):
        return PeerVerdict(compatible=False, stock_peer=True)
    remote = decode(remote_wire)
    found = differences(local, remote, local_role)
    return PeerVerdict(compatible=not found, differences=found, remote=remote)


def _hint(field_name: str) -> str | None:
    return FIELD_HINTS.get(field_name.rsplit(".", 1)[-1])


def describe_differences(
    found: list[Difference], local_name: str = "this engine", remote_name: str = "peer"
) -> str:
    """``field: this engine X, peer Y`` lines followed by what to change."""
    lines = [
        f"  {item.field}: {local_name} {item.local!r}, {remote_name} {item.remote!r}"
        for item in found
    ]
    hints = []
    for item in found:
        hint = item.hint or _hint(item.field)
        if hint and hint not in hints:
            hints.append(hint)
    if not hints:
        hints.append("start both engines with identical model and cache settings")
    return "\n".join(lines) + "\nTo fix: " + "; ".join(hints) + "."


def mismatch_message(
    found: list[Difference], local_role: str, remote_role: str, remote_where: str
) -> str:
    return (
        f"vllm-hybrid-nixl refused KV transfer with {remote_role} engine {remote_where}: "
        f"the KV-cache layouts differ, so its blocks would be read as garbage.\n"
        + describe_differences(found, f"{local_role} (this engine)", remote_role)
    )


def stock_peer_message(remote_role: str, remote_where: str) -> str:
    return (
        f"vllm-hybrid-nixl refused KV transfer with {remote_role} engine {remote_where}: it runs "
        "vLLM's stock NixlConnector, which does not check hybrid KV-cache layouts (mismatched "
        "layouts then return wrong tokens silently). Start it with "
        '"kv_connector": "HybridNixlConnector", or, if you accept that risk, set '
        '"kv_connector_extra_config": {"allow_stock_peer": true} on this engine and '
        '{"enforce_handshake_compat": false} on the stock one.'
    )

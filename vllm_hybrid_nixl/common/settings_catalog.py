"""Every ``kv_connector_extra_config`` key and environment variable the package reads or sets.

The one declaration the configuration reference (``docs/reference/configuration.md``) is
generated from; ``tests/unit/test_reference_docs.py`` fails when the code reads or sets a key
that is not declared here, or when a key declared here is no longer used.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Setting:
    name: str
    used_by: str  # who reads or sets it
    meaning: str


EXTRA_CONFIG_KEYS = (
    Setting(
        "allow_stock_peer",
        "our worker (default `false`)",
        "accept a stock `NixlConnector` peer, whose layout cannot be verified",
    ),
    Setting(
        "kv_lease_duration",
        "vLLM and our lease table (prefill engine; default 30)",
        "seconds a finished request's blocks wait for a decode engine to pin them",
    ),
    Setting(
        "kv_pin_duration",
        "our lease table (prefill; default `max(lease, 30)`)",
        "seconds a pinned request's blocks wait for the read to complete",
    ),
    Setting(
        "lease_port",
        "our prefill engine (default: the side-channel port + 1000; 0: a free port)",
        "port of the lease service, on the side-channel host; the data-parallel rank is added",
    ),
    Setting(
        "lease_check_timeout",
        "our decode engine (default 2)",
        "seconds to wait for a prefill engine's answer to a pin, per try (a silent service "
        "is refused after three; four with `direct_pins`)",
    ),
    Setting("lease_guard", "both engines (default `true`)", "`false` turns the lease guard off"),
    Setting(
        "direct_pins",
        "our decode engine (default `false`)",
        "`true` sends a pin from the scheduler's thread as its request arrives and reads the "
        "answer at the next schedule, with no thread handoff (more requests find their pin "
        "answered at their first schedule; measured slower end to end on 2 CPU cores, see "
        "Benchmarks); `false` pins on a background thread",
    ),
    Setting(
        "kv_digest",
        "both workers (default `true`)",
        "verify every KV read byte for byte: the prefill serves per-page digests (side-channel "
        "port + 500 + TP rank), the decode fails a read whose bytes differ; `false` turns it off",
    ),
    Setting(
        "kv_digest_timeout",
        "our decode worker (default 10)",
        "seconds a completed read waits for its prefill's digests before it fails",
    ),
    Setting(
        "reads_before_forward",
        "our connector, every worker (default `true` on vLLM's CPU platform; `true` is "
        "refused elsewhere)",
        "start a step's KV reads when the step's metadata is bound, before its forward; vLLM "
        "starts them after launching the forward, which on CPU is after the whole forward",
    ),
    Setting(
        "progress_poll_us",
        "our worker (default `0`; `1000` recommended on vLLM's CPU platform)",
        "NIXL's progress thread waits for transport events, at most this long, instead of "
        "busy-polling a core; `0` keeps NIXL's spinning thread",
    ),
    Setting(
        "idle_progress_thread",
        "our worker (default `true` on vLLM's CPU platform when the progress thread spins)",
        "run a spinning NIXL progress thread at idle priority",
    ),
)

ENVIRONMENT = (
    Setting("VLLM_HYBRID_NIXL_API_KEY", "router (read)", "key clients must send (Bearer)"),
    Setting(
        "VLLM_HYBRID_NIXL_ENGINE_API_KEY",
        "router, Ray launcher (read)",
        "key the engines require; the launcher sets it as each engine's `VLLM_API_KEY`",
    ),
    Setting("VLLM_API_KEY", "set for engines by the Ray launcher", "vLLM's own engine key"),
    Setting(
        "VLLM_NIXL_SIDE_CHANNEL_HOST",
        "set by our launchers and the container entry point",
        "where an engine's NIXL side channel listens (the node's or container's address)",
    ),
    Setting(
        "VLLM_NIXL_SIDE_CHANNEL_PORT",
        "set by our launchers (a free port)",
        "the side channel's port; the lease service listens 1000 above it, the KV digest "
        "service 500 above it (plus the TP rank)",
    ),
    Setting(
        "VLLM_CPU_KVCACHE_SPACE",
        "set (default 1 GiB) for CPU engines we start",
        "vLLM's CPU KV-cache size",
    ),
    Setting(
        "VLLM_CPU_OMP_THREADS_BIND",
        "set per CPU engine by our launchers (`placement.engine_cores`)",
        "the cores each engine computes on (its processes are confined to them too)",
    ),
    Setting(
        "UCX_NET_DEVICES",
        "set to `lo` for engines bound to a loopback address",
        "keep NIXL's transport on loopback",
    ),
    Setting(
        "VLLM_HTTP_TIMEOUT_KEEP_ALIVE",
        "set to 75 for engines our launchers and the container start (unless set)",
        "idle engine connections outlast the router's pool",
    ),
    Setting("HF_HUB_OFFLINE", "set to 1 by the demo", "no model downloads"),
    Setting(
        "VLLM_HYBRID_NIXL_KV_TIMELINE",
        "decode engine (read; unset by default)",
        "a file path: the decode engine appends a JSON line per step of each request's KV "
        "path (pin, schedule, read, digest, report); `python -m bench.kv_timeline` reads it",
    ),
    Setting(
        "CXX",
        "read by the container image's entry point (default g++)",
        "the C++ compiler torch.compile would use: where neither it nor g++ is on PATH (the "
        "CPU image has none), engines of vLLM's CPU build start with --enforce-eager",
    ),
    Setting(
        "TORCH_COMPILE_DISABLE",
        "set to 1 by the container image's entry point where no C++ compiler is on PATH "
        "(unless already set); read by torch",
        "torch.compile runs functions eagerly: vLLM compiles small helpers even with "
        "--enforce-eager (the sampler's logprob ranks), which would kill the engine there",
    ),
    Setting(
        "PATH",
        "read by the container image's entry point",
        "where it looks for that C++ compiler",
    ),
    Setting(
        "HEALTH_PORT",
        "read by the container image's HEALTHCHECK (default 8100 in the CPU image)",
        "the port whose `/health` the image's health check asks (8200 for a decode engine "
        "container serving there, 8000 for a router container)",
    ),
    Setting(
        "VLLM_HYBRID_NIXL_DRAIN_S",
        "read by engines our launcher starts (default 60)",
        "on SIGTERM, how long an engine refusing new requests (503) waits for the ones it "
        "accepted before vLLM's own shutdown (`--shutdown-timeout`, default 45 s) starts",
    ),
    Setting(
        "VLLM_TARGET_DEVICE",
        "set to `cpu` by our launcher when only vLLM's CPU build is installed",
        "steers vLLM's platform detection",
    ),
    Setting("VLLM_LOGGING_LEVEL", "set to `WARNING` by `check` (unless set)", "quiet start-up"),
    Setting(
        "VLLM_SSM_CONV_STATE_LAYOUT",
        "read by `check`; set to `DS` for Mamba engines by our launchers",
        "Mamba state moves over NIXL only in the `DS` layout",
    ),
)

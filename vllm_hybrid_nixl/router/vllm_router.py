"""vllm-router (the Rust P/D router, PyPI ``vllm-router``) as the data plane in front of our
engines, started after our layout-pairing check (:func:`refuse_incompatible_pairs`).

vllm-router does not read layout fingerprints: it pairs any prefill with any decode engine,
so this module starts it only over a pool every pair of which our check approved, and
refuses what it would not honour (keys; per-pair refusals; a pool that does not pair).
Our router settings map onto its flags where they mean the same thing
(:func:`vllm_router_args`); the rest keep vllm-router's own defaults.
"""

from __future__ import annotations

import shutil
import subprocess
import sys
import time
from pathlib import Path

import httpx

from vllm_hybrid_nixl.common.netutil import free_port
from vllm_hybrid_nixl.common.processes import die_with_parent, stop_child
from vllm_hybrid_nixl.router.backends import BackendPool
from vllm_hybrid_nixl.router.pairing import read_pool_pairing
from vllm_hybrid_nixl.router.server import RouterSetup
from vllm_hybrid_nixl.router.settings import RouterKeys, RouterSettings

#: Our policy -> vllm-router's nearest one (power_of_two: the less loaded of two engines).
POLICY = {
    "least_in_flight": "power_of_two",
    "round_robin": "round_robin",
    "prefix_affinity": "cache_aware",
}
INSTALL_HINT = "pip install 'vllm-hybrid-nixl[vllm-router]'"


class VllmRouterError(RuntimeError):
    """vllm-router cannot be used here; the message says what to change."""


def vllm_router_binary() -> str:
    """The ``vllm-router`` executable beside this Python, else on PATH."""
    beside = Path(sys.executable).with_name("vllm-router")
    if beside.is_file():
        return str(beside)
    found = shutil.which("vllm-router")
    if found is None:
        raise VllmRouterError(
            f"router kind 'vllm-router' needs the vllm-router executable: {INSTALL_HINT}, "
            "or use the default router (kind: vllm-hybrid-nixl)"
        )
    return found


def refuse_what_vllm_router_would_not_honour(keys: RouterKeys) -> None:
    """Keys: this launcher does not hand keys to vllm-router, so it would serve without the
    client check the user asked for (or fail every leg against keyed engines)."""
    if keys.api_key or keys.engine_api_key:
        raise VllmRouterError(
            "router kind 'vllm-router' is started without API keys by this launcher, but a "
            "client or engine key is set (VLLM_HYBRID_NIXL_API_KEY / "
            "VLLM_HYBRID_NIXL_ENGINE_API_KEY); unset them, or use the default router "
            "(kind: vllm-hybrid-nixl), which checks client keys and sends the engine key"
        )


def refuse_unchecked_pairs(pool: BackendPool, timeout_s: float = 10.0) -> None:
    """Every prefill/decode pair must be layout-checked and compatible: vllm-router cannot
    leave out a pair, so one bad or unreadable pair refuses the whole pool."""
    problems, unread = read_pool_pairing(pool, timeout_s)
    if unread:
        problems.append(
            f"the KV-cache layout of {', '.join(unread)} could not be read from its NIXL "
            "side channel (pass the side channels, and check the engines run "
            "HybridNixlConnector)"
        )
    if problems:
        raise VllmRouterError(
            "refusing to start vllm-router: it pairs every prefill engine with every decode "
            "engine, and these pairs are not known to be compatible:\n" + "\n".join(problems)
        )


def vllm_router_args(
    pool: BackendPool, host: str, port: int, metrics_port: int, settings: RouterSettings
) -> list[str]:
    """vllm-router's command line for ``pool`` with our settings where they map."""
    args = ["--vllm-pd-disaggregation"]
    for backend in pool.prefill:
        args += ["--prefill", backend.url]
    for backend in pool.decode:
        args += ["--decode", backend.url]

    def policy(ours: str, engines: int) -> str:
        # vllm-router refuses power_of_two over one engine; with one there is nothing to pick
        return POLICY[ours] if engines >= 2 else "round_robin"

    timeout = max(settings.prefill_timeout_s, settings.decode_read_timeout_s)
    args += [
        "--host", host, "--port", str(port),
        "--prometheus-host", "127.0.0.1", "--prometheus-port", str(metrics_port),
        "--prefill-policy", policy(settings.prefill_policy, len(pool.prefill)),
        "--decode-policy", policy(settings.decode_policy, len(pool.decode)),
        "--request-timeout-secs", str(max(1, round(timeout))),
        "--max-payload-size", str(settings.max_body_bytes),
        "--health-check-interval-secs", str(max(1, round(settings.probe_interval_s))),
        "--health-check-timeout-secs", str(max(1, round(settings.health_timeout_s))),
    ]  # fmt: skip
    return args


class VllmRouterProcess(RouterSetup):
    """vllm-router over ``pool`` on ``host:port`` (0: a free port), the same interface as
    :class:`~vllm_hybrid_nixl.router.server.RouterProcess`; stopped by its PID."""

    def __init__(
        self,
        pool: BackendPool,
        host: str = "127.0.0.1",
        port: int = 0,
        settings: RouterSettings | None = None,
        keys: RouterKeys | None = None,
        log_path: str | Path | None = None,
    ) -> None:
        super().__init__(pool, host, port, settings, keys)
        self.metrics_port = free_port()
        self.log_path = Path(log_path) if log_path else None
        self._process: subprocess.Popen[bytes] | None = None

    @property
    def metrics_url(self) -> str:
        return f"http://127.0.0.1:{self.metrics_port}/metrics"

    @property
    def pid(self) -> int | None:
        return self._process.pid if self._process else None

    def start(self, timeout_s: float = 120.0) -> VllmRouterProcess:
        """Checks keys and every pair's layout, starts vllm-router, waits for its /health."""
        refuse_what_vllm_router_would_not_honour(self.keys)
        binary = vllm_router_binary()
        refuse_unchecked_pairs(self.pool)
        args = vllm_router_args(self.pool, self.host, self.port, self.metrics_port, self.settings)
        # Its log: a file when given, else this process's own stdout and stderr.
        log = open(self.log_path, "ab") if self.log_path else None  # noqa: SIM115
        try:
            self._process = subprocess.Popen(
                [binary, *args],
                stdout=log,
                stderr=subprocess.STDOUT if log else None,
                preexec_fn=die_with_parent,
            )
        finally:
            if log is not None:
                log.close()
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self._process.poll() is not None:
                code = self._process.returncode
                raise VllmRouterError(
                    f"vllm-router exited with code {code} before serving"
                    + (f"; see {self.log_path}" if self.log_path else "")
                )
            try:
                if httpx.get(f"{self.url}/health", timeout=2).status_code == 200:
                    return self
            except httpx.HTTPError:
                pass
            time.sleep(0.25)
        self.stop()
        raise VllmRouterError(f"vllm-router did not answer /health within {timeout_s:.0f}s")

    def wait(self) -> int:
        """Until vllm-router exits; its exit code."""
        if self._process is None:
            raise RuntimeError("VllmRouterProcess.start() was not called")
        return self._process.wait()

    def stop(self) -> None:
        stop_child(self._process)

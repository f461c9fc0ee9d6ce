"""Start a whole P/D deployment on Ray: engine actors, readiness, the router; stop it all."""

from __future__ import annotations

import sys
import tempfile
import time
from dataclasses import dataclass, field
from typing import Any

import httpx
import ray

from vllm_hybrid_nixl.common.cpus import usable_cpus
from vllm_hybrid_nixl.deploy.keepalive import router_keep_alive_s
from vllm_hybrid_nixl.deploy.pd_client import LegError, disaggregated_completion
from vllm_hybrid_nixl.deploy.placement import PlacedEngine, core_shares
from vllm_hybrid_nixl.deploy.ray.actors import EngineActor
from vllm_hybrid_nixl.deploy.ray.config import ConfigError, PDConfig
from vllm_hybrid_nixl.router.backends import BackendPool
from vllm_hybrid_nixl.router.pairing import read_pool_pairing
from vllm_hybrid_nixl.router.server import RouterProcess
from vllm_hybrid_nixl.router.settings import (
    VLLM_ENGINE_KEY_ENV,
    RouterKeys,
    RouterSettings,
    refuse_open_router,
)
from vllm_hybrid_nixl.router.vllm_router import (
    VllmRouterProcess,
    refuse_what_vllm_router_would_not_honour,
    vllm_router_binary,
)

# Ray turns a node IP of exactly 127.0.0.1 into the machine's outward address; any other
# loopback address is kept, so a local cluster binds 127.0.0.2 and all traffic stays on lo.
LOCAL_NODE_IP = "127.0.0.2"


#: P/D requests a (prefill, decode) pair gets to prove it can move KV at start-up.
WARM_UP_ATTEMPTS = 3


class EngineNotReadyError(RuntimeError):
    """An engine died or did not answer /health in time; names it and shows its log tail."""


class IncompatibleEnginesError(RuntimeError):
    """Engines came up with KV-cache layouts that must not exchange KV."""


@dataclass
class EngineHandle:
    name: str
    role: str
    actor: Any
    info: dict[str, Any] = field(default_factory=dict)


def _say(message: str) -> None:
    print(message, file=sys.stderr, flush=True)


def refuse_incompatible_pairs(pool: BackendPool) -> None:
    """Raise when some prefill/decode pair has different KV-cache layout fingerprints."""
    problems, unknown = read_pool_pairing(pool)
    if unknown:
        _say(f"warning: could not read the KV-cache layout of {', '.join(unknown)}")
    if problems:
        raise IncompatibleEnginesError(
            "refusing to pair engines whose KV-cache layouts differ:\n" + "\n".join(problems)
        )
    _say("layouts: every prefill/decode pair has the same KV-cache layout fingerprint")


def with_engine_keep_alive(settings: RouterSettings, config: PDConfig) -> RouterSettings:
    """The router keeps idle engine connections for a share of the keep-alive these engines
    get (deploy/keepalive.py), unless the operator set ``keepalive_expiry_s``."""
    if "keepalive_expiry_s" in settings.model_fields_set:
        return settings
    keep = router_keep_alive_s(dict(config.env))
    return settings if keep is None else settings.model_copy(update={"keepalive_expiry_s": keep})


class PDDeployment:
    """``start()`` brings up engines and router; ``stop()`` (or leaving ``with``) ends them."""

    def __init__(
        self,
        config: PDConfig,
        router_settings: RouterSettings | None = None,
        keys: RouterKeys | None = None,
    ) -> None:
        """``keys`` default to the environment (``RouterKeys.from_env``); the engine key is
        handed to each engine as its ``VLLM_API_KEY``."""
        self.config = config
        self.router_settings = with_engine_keep_alive(router_settings or config.router, config)
        self.keys = keys if keys is not None else RouterKeys.from_env()
        self.engines: list[EngineHandle] = []
        self.router: RouterProcess | VllmRouterProcess | None = None
        self.log_dir = config.log_dir or tempfile.mkdtemp(prefix="vllm-hybrid-nixl-")
        self._started_ray = False

    # ---- lifecycle ---------------------------------------------------------------

    def __enter__(self) -> PDDeployment:
        try:
            return self.start()
        except BaseException:
            self.stop()
            raise

    def __exit__(self, *_: object) -> None:
        self.stop()

    def start(self) -> PDDeployment:
        refuse_open_router(self.config.router_host, self.router_settings, self.keys)
        if self.router_settings.kind == "vllm-router":  # before any engine starts
            refuse_what_vllm_router_would_not_honour(self.keys)
            vllm_router_binary()
        self._connect()
        self._check_resources()
        self._start_engines()
        self._wait_ready()
        pool = BackendPool.from_urls(
            [e.info["url"] for e in self.engines if e.role == "prefill"],
            [e.info["url"] for e in self.engines if e.role == "decode"],
            [e.info["side_channel"] for e in self.engines if e.role == "prefill"],
            [e.info["side_channel"] for e in self.engines if e.role == "decode"],
        )
        refuse_incompatible_pairs(pool)
        self._warm_up_pairs()
        ray.get([e.actor.supervise.remote() for e in self.engines], timeout=60)
        self.router = self._data_plane(pool).start()
        return self

    def _data_plane(self, pool: BackendPool) -> RouterProcess | VllmRouterProcess:
        """The router kind the settings name, over ``pool`` (layouts already checked)."""
        where = (pool, self.config.router_host, self.config.router_port, self.router_settings)
        if self.router_settings.kind == "vllm-router":
            log = f"{self.log_dir}/vllm-router.log"
            return VllmRouterProcess(*where, self.keys, log_path=log)
        return RouterProcess(*where, self.keys)

    def stop(self) -> None:
        if self.router is not None:
            self.router.stop()
            self.router = None
        if self.engines:
            try:
                ray.get([e.actor.stop.remote() for e in self.engines], timeout=60)
            except Exception as exc:  # an actor that is already gone has nothing to stop
                _say(f"warning: stopping engines: {exc}")
            for engine in self.engines:
                ray.kill(engine.actor)
            self.engines = []
        if self._started_ray and ray.is_initialized():
            ray.shutdown()
            self._started_ray = False

    # ---- steps -----------------------------------------------------------------------

    def _connect(self) -> None:
        if ray.is_initialized():
            return
        if self.config.address:
            ray.init(address=self.config.address, log_to_driver=False)
        else:
            # The CPUs this process may use: Ray's own count ignores CPU affinity.
            ray.init(
                _node_ip_address=LOCAL_NODE_IP,
                num_cpus=usable_cpus(),
                include_dashboard=False,
                log_to_driver=False,
            )
        self._started_ray = True

    def _check_resources(self) -> None:
        config = self.config
        per_engine = {"CPU": config.engine_num_cpus, "GPU": config.resolved_num_gpus()}
        needed: dict[str, float] = {}
        for count, extra in (
            (config.num_prefill, config.prefill_resources),
            (config.num_decode, config.decode_resources),
        ):
            for name, amount in {**per_engine, **extra}.items():
                needed[name] = needed.get(name, 0.0) + amount * count
        available = ray.cluster_resources()
        short = {
            name: (amount, available.get(name, 0.0))
            for name, amount in needed.items()
            if amount > available.get(name, 0.0) + 1e-9
        }
        if short:
            detail = ", ".join(
                f"{name}: need {need:g}, cluster has {have:g}"
                for name, (need, have) in short.items()
            )
            raise ConfigError(
                f"{config.num_prefill} prefill + {config.num_decode} decode engines do not fit "
                f"the Ray cluster ({detail}); lower the engine counts, engine_num_cpus / "
                "engine_num_gpus, or add nodes"
            )

    def _start_engines(self) -> None:
        config = self.config
        kv_buffer_device = config.resolved_kv_buffer_device()
        env = dict(config.env)
        if self.keys.engine_api_key:
            env[VLLM_ENGINE_KEY_ENV] = self.keys.engine_api_key
        for role, count, extra in (
            ("prefill", config.num_prefill, config.prefill_resources),
            ("decode", config.num_decode, config.decode_resources),
        ):
            for i in range(count):
                name = f"{role}-{i}"
                actor = EngineActor.options(
                    name=None,
                    num_cpus=config.engine_num_cpus,
                    num_gpus=config.resolved_num_gpus(),
                    resources=extra or None,
                ).remote(
                    name,
                    role,
                    config.model,
                    config.connector,
                    kv_buffer_device,
                    config.serve_args(),
                    env,
                    self.log_dir,
                    None,
                    config.engine_max_restarts,
                    config.engine_restart_backoff_s,
                )
                self.engines.append(EngineHandle(name, role, actor))
        cores = self._cores_per_engine()
        infos = ray.get([e.actor.start.remote(cores[e.name]) for e in self.engines], timeout=300)
        for engine, info in zip(self.engines, infos, strict=True):
            engine.info = info
            _say(
                f"  {engine.name}: {info['url']} on node {info['node_ip']} "
                f"(NIXL side channel {info['side_channel']}, log {info['log']})"
            )

    def _cores_per_engine(self) -> dict[str, list[int]]:
        """Each engine's share of the cores of the machine Ray placed it on (prefill and
        decode engines of one machine on disjoint cores while there are enough, whichever
        raylets they are on: :func:`placement.core_shares`)."""
        facts = ray.get([e.actor.node_facts.remote() for e in self.engines], timeout=120)
        placed = [
            PlacedEngine(engine.name, engine.role, machine, tuple(cores))
            for engine, (cores, machine) in zip(self.engines, facts, strict=True)
        ]
        return core_shares(placed)

    def _wait_ready(self) -> None:
        deadline = time.monotonic() + self.config.startup_timeout_s
        started = time.monotonic()
        last_report = -10.0
        pending = list(self.engines)
        while pending:
            statuses = ray.get([e.actor.status.remote() for e in pending], timeout=60)
            still = []
            for engine, status in zip(pending, statuses, strict=True):
                if status["healthy"]:
                    _say(f"  {engine.name} ready after {time.monotonic() - started:.0f}s")
                    continue
                if not status["alive"]:
                    raise EngineNotReadyError(
                        f"engine {engine.name} ({engine.info.get('url')}) exited with code "
                        f"{status['returncode']} before it was ready; last log lines "
                        f"({engine.info.get('log')}):\n" + ray.get(engine.actor.log_tail.remote())
                    )
                still.append(engine)
            pending = still
            if not pending:
                break
            elapsed = time.monotonic() - started
            if time.monotonic() > deadline:
                engine = pending[0]
                raise EngineNotReadyError(
                    f"engine {engine.name} ({engine.info.get('url')}) was not ready after "
                    f"{elapsed:.0f}s (startup_timeout_s); last log lines "
                    f"({engine.info.get('log')}):\n" + ray.get(engine.actor.log_tail.remote())
                )
            if elapsed - last_report >= 10:
                last_report = elapsed
                _say(f"  waiting for {', '.join(e.name for e in pending)} ({elapsed:.0f}s)")
            time.sleep(1.0)

    def _warm_up_pairs(self) -> None:
        """One tiny P/D request per (prefill, decode) pair before the router opens.

        The first NIXL transfer between two engines sets up their connection, which took
        tens of seconds here; doing it now keeps it off the first user's request, and proves
        every pair can move KV before the deployment is announced ready.
        """
        body = {
            "model": self.config.model,
            "prompt": "warm up",
            "max_tokens": 1,
            "temperature": 0.0,
        }
        prefills = [e for e in self.engines if e.role == "prefill"]
        decodes = [e for e in self.engines if e.role == "decode"]
        with httpx.Client(
            timeout=self.config.startup_timeout_s, headers=self.keys.engine_headers()
        ) as client:
            for p in prefills:
                for d in decodes:
                    self._warm_up_pair(client, p, d, body)

    def _warm_up_pair(self, client: httpx.Client, p: Any, d: Any, body: dict[str, Any]) -> None:
        """A first handshake between two loaded engines may time out (vLLM's and our side
        channel reads wait 5 s); vLLM handshakes again on the next request, so a pair gets
        ``WARM_UP_ATTEMPTS`` tries before the deployment is called not ready."""
        started = time.monotonic()
        for attempt in range(1, WARM_UP_ATTEMPTS + 1):
            try:
                disaggregated_completion(client, p.info["url"], d.info["url"], body)
                break
            except (LegError, httpx.HTTPError) as exc:
                if attempt == WARM_UP_ATTEMPTS:
                    raise EngineNotReadyError(
                        f"engines {p.name} and {d.name} are up but {attempt} P/D requests "
                        f"between them failed, the last with: {exc}; see {p.info['log']} and "
                        f"{d.info['log']}"
                    ) from exc
                _say(f"  {p.name} -> {d.name}: attempt {attempt} failed ({exc}); again")
        _say(f"  {p.name} -> {d.name}: KV transfer path ready ({time.monotonic() - started:.1f}s)")

    # ---- facts for callers -------------------------------------------------------------

    def rolling_restart(self, timeout_s: float | None = None) -> list[dict[str, Any]]:
        """Restart every engine, one at a time, prefill engines first: each drains and exits
        (the router takes it out of rotation at once), starts again on its ports, and the
        next one follows once the router has it back in rotation. Each engine's answer
        (its stop's seconds and exit code among it)."""
        if self.router is None:
            raise RuntimeError("the deployment is not started")
        timeout_s = timeout_s or self.config.startup_timeout_s
        done = []
        for engine in sorted(self.engines, key=lambda e: e.role != "prefill"):
            _say(f"rolling restart: {engine.name} drains and restarts")
            answer = ray.get(engine.actor.restart.remote(), timeout=timeout_s)
            engine.info.update({k: v for k, v in answer.items() if k in engine.info})
            self._wait_in_rotation(engine, time.monotonic() + timeout_s)
            _say(
                f"rolling restart: {engine.name} back (stopped in {answer['stopped_s']} s, "
                f"exit code {answer['exit_code']})"
            )
            done.append(answer)
        return done

    def _wait_in_rotation(self, engine: EngineHandle, deadline: float) -> None:
        """Until ``engine`` serves and the router lists it as up."""
        url = engine.info["url"]
        while time.monotonic() < deadline:
            status = ray.get(engine.actor.status.remote(), timeout=60)
            if not status["alive"]:
                raise EngineNotReadyError(
                    f"engine {engine.name} ({url}) exited with code {status['returncode']} "
                    "after its restart; last log lines:\n" + ray.get(engine.actor.log_tail.remote())
                )
            if status["healthy"] and self._router_lists_up(url):
                return
            time.sleep(1.0)
        raise EngineNotReadyError(f"engine {engine.name} ({url}) was not back in rotation in time")

    def _router_lists_up(self, engine_url: str) -> bool:
        headers = {}
        if self.router_settings.protect_probes and self.keys.api_key:
            headers["Authorization"] = f"Bearer {self.keys.api_key}"
        try:
            report = httpx.get(f"{self.router_url}/health", headers=headers, timeout=10).json()
        except (httpx.HTTPError, ValueError):
            return False
        engines = report.get("engines", []) if isinstance(report, dict) else []
        return any(e.get("url") == engine_url and e.get("up") for e in engines)

    @property
    def router_url(self) -> str:
        if self.router is None:
            raise RuntimeError("the deployment is not started")
        return self.router.url

    def urls(self, role: str) -> list[str]:
        return [e.info["url"] for e in self.engines if e.role == role]

"""Run a deployment until Ctrl-C / SIGTERM, then stop everything it started; SIGHUP restarts
its engines one at a time (:meth:`PDDeployment.rolling_restart`), serving throughout."""

from __future__ import annotations

import signal
import sys
import threading

from vllm_hybrid_nixl.deploy.ray.config import ConfigError, PDConfig
from vllm_hybrid_nixl.deploy.ray.deployment import (
    EngineNotReadyError,
    IncompatibleEnginesError,
    PDDeployment,
)
from vllm_hybrid_nixl.router.auth import EngineAccessError
from vllm_hybrid_nixl.router.settings import UnsafeBindError
from vllm_hybrid_nixl.router.vllm_router import VllmRouterError

SIGNALS = (signal.SIGINT, signal.SIGTERM)


def serve_until_signalled(config: PDConfig) -> int:
    """Start engines and router, print ``router: URL``, block until a signal; 0 on clean exit.

    A signal during start-up interrupts it; either way everything started is stopped.
    """
    stop = threading.Event()
    serving = threading.Event()
    restart = threading.Event()

    def on_hangup(_signum: int, _frame: object) -> None:
        print("received SIGHUP: rolling restart of the engines", file=sys.stderr, flush=True)
        restart.set()

    def on_signal(signum: int, _frame: object) -> None:
        print(f"received {signal.Signals(signum).name}, shutting down", file=sys.stderr)
        stop.set()
        if not serving.is_set():
            raise KeyboardInterrupt

    previous = {sig: signal.signal(sig, on_signal) for sig in SIGNALS}
    deployment = PDDeployment(config)
    try:
        deployment.start()
        for sig in SIGNALS:  # ray.init installs handlers of its own that abort the driver
            signal.signal(sig, on_signal)
        signal.signal(signal.SIGHUP, on_hangup)
        serving.set()
        print(f"router: {deployment.router_url}", flush=True)
        while not stop.wait(1.0):
            if restart.is_set():
                restart.clear()
                try:
                    deployment.rolling_restart()
                    print("rolling restart done", file=sys.stderr, flush=True)
                except EngineNotReadyError as exc:  # keep serving with what runs
                    print(f"error: rolling restart stopped: {exc}", file=sys.stderr, flush=True)
        return 0
    except KeyboardInterrupt:
        return 130
    except (
        ConfigError,
        EngineNotReadyError,
        IncompatibleEnginesError,
        EngineAccessError,
        UnsafeBindError,
        VllmRouterError,
    ) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    finally:
        signal.signal(signal.SIGHUP, signal.SIG_DFL)
        deployment.stop()
        for sig, handler in previous.items():
            signal.signal(sig, handler)

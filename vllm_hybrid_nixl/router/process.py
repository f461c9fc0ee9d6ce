"""The router's own process (see ``RouterProcess``): reads its pool, address, settings and
keys (pickled) from stdin, serves until SIGTERM, and prints one line once it listens."""

from __future__ import annotations

import os
import pickle
import sys
import threading
import time

import uvicorn

from vllm_hybrid_nixl.router.server import READY_LINE, configure_router_logging, uvicorn_config


def main() -> None:
    pool, host, port, settings, keys = pickle.loads(sys.stdin.buffer.read())
    configure_router_logging()
    server = uvicorn.Server(uvicorn_config(pool, host, port, settings, keys))

    def announce() -> None:
        while not server.started and not server.should_exit:
            time.sleep(0.05)
        if server.started:
            sys.stdout.buffer.write(READY_LINE + f" on http://{host}:{port}\n".encode())
            sys.stdout.flush()
            os.dup2(2, 1)  # nobody reads the pipe after this line: later output goes to stderr

    threading.Thread(target=announce, name="announce", daemon=True).start()
    server.run()


if __name__ == "__main__":
    main()

"""NIXL's progress thread paced (``connector.progress_pacing``): real NIXL agents, each set
made in a child process of its own (an agent's threads outlive it and would keep polling in
the test process)."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from vllm_hybrid_nixl.connector import compat
from vllm_hybrid_nixl.connector.progress_pacing import (
    DEFAULT_POLL_US,
    POLL_KEY,
    bindings_of,
    paced_agents,
)
from vllm_hybrid_nixl.connector.worker import progress_poll_us

pytestmark = pytest.mark.integration

MEASURE = r"""
import json, sys, time
from vllm_hybrid_nixl.connector import compat
from vllm_hybrid_nixl.connector.progress_pacing import paced_agents
from vllm_hybrid_nixl.connector.thread_priority import cpu_seconds as cpu, thread_ids

def shares(threads, seconds=1.5):
    before = {t: cpu(t) for t in threads}
    time.sleep(seconds)
    return max((cpu(t) - before[t]) / seconds for t in threads)

agent_class = compat.nixl_agent_class()
result, agents = {}, []
for name, poll_us in (("paced", 1000), ("stock", 0)):
    existing = thread_ids()
    with paced_agents(agent_class, poll_us) as paced:
        agents.append(agent_class(name, None))  # kept: a dropped agent stops its threads
    started = thread_ids() - existing
    result[name] = {"paced": paced, "busiest": shares(started)}
result["restored"] = type(sys.modules[agent_class.__module__].nixlBind).__name__ == "module"
print(json.dumps(result))
"""


def test_a_paced_agent_waits_for_events_where_a_stock_one_spins() -> None:
    done = subprocess.run(
        [sys.executable, "-c", MEASURE], capture_output=True, text=True, timeout=300
    )
    assert done.returncode == 0, done.stderr[-3000:]
    result = json.loads(done.stdout.strip().splitlines()[-1])
    assert result["paced"]["paced"] is True and result["stock"]["paced"] is False
    # a pacing thread wakes once a millisecond (0.02 of a core here); NIXL's own spins (1.0)
    assert result["paced"]["busiest"] < 0.3, result
    assert result["stock"]["busiest"] > 0.5, result
    assert result["restored"], "the NIXL module got its own bindings back"


def test_bindings_are_restored_when_building_the_agent_fails() -> None:
    agent_class = compat.nixl_agent_class()
    assert agent_class is not None
    module = sys.modules[agent_class.__module__]
    original = module.nixlBind
    with pytest.raises(RuntimeError, match="boom"):
        with paced_agents(agent_class, 1000) as paced:
            assert paced and module.nixlBind is not original
            raise RuntimeError("boom")
    assert module.nixlBind is original


def test_classes_that_are_not_nixl_agents_are_left_alone() -> None:
    class NotAnAgent:
        pass

    assert bindings_of(NotAnAgent) is None
    with paced_agents(NotAnAgent, 1000) as paced:
        assert paced is False
    with paced_agents(None, 1000) as paced:
        assert paced is False


def kv_config(extra: dict) -> object:
    from vllm.config import KVTransferConfig

    return KVTransferConfig(
        kv_connector="HybridNixlConnector", kv_role="kv_both", kv_connector_extra_config=extra
    )


def test_the_pause_is_opt_in_and_can_be_set_or_turned_off() -> None:
    assert progress_poll_us(kv_config({})) == 0
    assert progress_poll_us(None) == 0
    assert progress_poll_us(kv_config({POLL_KEY: DEFAULT_POLL_US})) == DEFAULT_POLL_US
    assert progress_poll_us(kv_config({POLL_KEY: 250})) == 250
    assert progress_poll_us(kv_config({POLL_KEY: 0})) == 0


@pytest.mark.parametrize("bad", [-1, 1.5, "1000", True])
def test_a_bad_pause_is_refused_with_what_to_write(bad: object) -> None:
    with pytest.raises(ValueError, match=r"progress_poll_us is .*whole number of microseconds"):
        progress_poll_us(kv_config({POLL_KEY: bad}))

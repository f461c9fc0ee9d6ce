"""Session-wide fixtures: tiny local models, built once per test run."""

from __future__ import annotations

import dataclasses
import os
import re
import time
from collections.abc import Iterable, Iterator
from pathlib import Path

import pytest

from vllm_hybrid_nixl.deploy.engines import EngineProcess

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")


@pytest.fixture(autouse=True)
def no_conv_state_layout_left_behind() -> Iterator[None]:
    """vLLM's CPU platform, initialised in the test process (dry runs, Ray Serve's config
    checks), writes its own ``VLLM_SSM_CONV_STATE_LAYOUT`` default into ``os.environ``;
    engines started later would inherit it instead of our launchers' DS. Each test leaves
    the variable as it found it."""
    before = os.environ.get("VLLM_SSM_CONV_STATE_LAYOUT")
    yield
    if before is None:
        os.environ.pop("VLLM_SSM_CONV_STATE_LAYOUT", None)
    else:
        os.environ["VLLM_SSM_CONV_STATE_LAYOUT"] = before


def cuda_build_on_cpu() -> bool:
    """vLLM's CUDA build put on the CPU platform (``VLLM_TARGET_DEVICE=cpu``), as the version
    matrix runs a release the registry serves only as a CUDA build: its Python classes, NIXL
    and the KV-cache planning work, but it has no CPU kernels, so no engine can start."""
    from vllm_hybrid_nixl.connector import compat

    found = compat.installed_vllm()
    return bool(found and found.distribution == "vllm") and (
        os.environ.get("VLLM_TARGET_DEVICE") == "cpu"
    )


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Engine tests and tests of vLLM's CPU build itself are skipped, with the reason, on a
    CUDA build put on the CPU platform; everywhere else they run."""
    if not cuda_build_on_cpu():
        return
    no_engines = pytest.mark.skip(
        reason="vLLM's CUDA build on the CPU platform has no CPU kernels: no engine can start"
    )
    not_cpu_build = pytest.mark.skip(reason="tests vLLM's CPU build (vllm-cpu), not installed")
    for item in items:
        if item.get_closest_marker("e2e") or item.get_closest_marker("bench"):
            item.add_marker(no_engines)
        elif item.get_closest_marker("cpu_build"):
            item.add_marker(not_cpu_build)


def pytest_collection_finish(session: pytest.Session) -> None:
    """When the run includes the container tests, their images start building now, on a
    thread of their own (tests/e2e/container_kit.py), while the tests before them run."""
    if session.config.option.collectonly or cuda_build_on_cpu():
        return
    if not any(item.path.name == "test_containers.py" for item in session.items):
        return
    from tests.e2e.container_kit import IMAGE_PREBUILD, ImagePrebuild

    directory = session.config._tmp_path_factory.mktemp("image-prebuild")  # type: ignore[attr-defined]
    session.config.stash[IMAGE_PREBUILD] = ImagePrebuild(directory)


@pytest.fixture(scope="session")
def tiny_mamba_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A 4-layer NemotronH: Mamba2 and attention layers (``M*M*``), float32."""
    from vllm_hybrid_nixl.tools.tiny_model import TinyModelSpec, build_tiny_model

    return build_tiny_model(tmp_path_factory.mktemp("tiny-nemotron-h"), TinyModelSpec("nemotron-h"))


@pytest.fixture(scope="session")
def tiny_hybrid_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A 4-layer Llama mixing sliding-window and full attention (2 KV-cache groups)."""
    from vllm_hybrid_nixl.tools.tiny_model import TinyModelSpec, build_tiny_model

    return build_tiny_model(tmp_path_factory.mktemp("tiny-llama-hybrid"), TinyModelSpec())


def engines_among(values: Iterable[object], depth: int = 2) -> Iterator[EngineProcess]:
    """The :class:`EngineProcess` objects among a test's fixture values, looking one or two
    levels into dataclasses, lists, tuples and dicts (``PdPair``, lists of engines)."""
    for value in values:
        if isinstance(value, EngineProcess):
            yield value
        elif depth > 0:
            if dataclasses.is_dataclass(value) and not isinstance(value, type):
                inner = [getattr(value, field.name) for field in dataclasses.fields(value)]
            elif isinstance(value, list | tuple):
                inner = list(value)
            elif isinstance(value, dict):
                inner = list(value.values())
            else:
                continue
            yield from engines_among(inner, depth - 1)


def log_excerpt(engine: EngineProcess, tail_lines: int = 30, notable_lines: int = 60) -> str:
    """What explains an engine's failure: its warnings, errors and tracebacks, then its last
    lines (the log path is in the section title)."""
    lines = engine.log_text().splitlines()
    notable = [line for line in lines if NOTABLE_LOG_LINE.search(line)][-notable_lines:]
    return "\n".join([*notable, "--- last lines ---", *lines[-tail_lines:]])


NOTABLE_LOG_LINE = re.compile(r"\b(WARNING|ERROR|CRITICAL)\b|Traceback|Error:|Fatal")


@pytest.hookimpl(wrapper=True)
def pytest_runtest_makereport(item: pytest.Item, call: pytest.CallInfo) -> pytest.TestReport:
    """A failed engine test's report carries excerpts of its engines' logs, so a failure in
    CI, where the logs are gone with the machine, still says what the engines saw."""
    report = yield
    if report.failed and call.when in ("setup", "call"):
        fixtures = getattr(item, "funcargs", {}) or {}
        seen: set[int] = set()
        for engine in engines_among(fixtures.values()):
            if id(engine) in seen:
                continue
            seen.add(id(engine))
            title = f"engine log: {engine.spec.role} on :{engine.spec.port} ({engine.log_path})"
            report.sections.append((title, log_excerpt(engine)))
    return report


def pytest_runtest_logreport(report: pytest.TestReport) -> None:
    """A failure's traceback is printed the moment it happens, not only in the end summary:
    a CI run cut short by its time limit still shows why each test failed."""
    if not report.failed:
        return
    text = report.longreprtext
    if len(text) > IMMEDIATE_FAILURE_CHARS:
        text = "...\n" + text[-IMMEDIATE_FAILURE_CHARS:]
    sections = "\n".join(f"--- {title} ---\n{body[-2000:]}" for title, body in report.sections)
    print(f"\n=== FAILED {report.nodeid} ({report.when}) ===\n{text}\n{sections}", flush=True)


IMMEDIATE_FAILURE_CHARS = 6000


def pytest_sessionstart(session: pytest.Session) -> None:
    session.config.stash[SUITE_STARTED] = time.monotonic()


def pytest_runtest_setup(item: pytest.Item) -> None:
    """With ``VHN_SUITE_DEADLINE_S`` set (CI sets it below its own limit), the run stops
    before the next test once that many seconds have passed, and still prints its summary."""
    limit = os.environ.get("VHN_SUITE_DEADLINE_S")
    if not limit:
        return
    elapsed = time.monotonic() - item.config.stash[SUITE_STARTED]
    if elapsed > float(limit):
        item.session.shouldstop = (
            f"suite deadline: {elapsed:.0f}s > VHN_SUITE_DEADLINE_S={limit}; tests left unrun"
        )
        pytest.fail(item.session.shouldstop, pytrace=False)


SUITE_STARTED = pytest.StashKey[float]()

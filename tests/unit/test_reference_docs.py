"""The generated references stay true: docs/reference/*.md equal what the parsers and the
settings catalog generate, every option has a meaning, and the catalog names exactly the
``kv_connector_extra_config`` keys and environment variables the package's code reads or sets."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest

from vllm_hybrid_nixl.common import settings_catalog

pytestmark = pytest.mark.unit

ROOT = Path(__file__).resolve().parents[2]
PACKAGE = ROOT / "vllm_hybrid_nixl"
CATALOG = PACKAGE / "common" / "settings_catalog.py"
# vLLM's reader, or ours for strict booleans (extra_settings.strict_bool(config, KEY, ...))
EXTRA_READ = re.compile(
    r"(?:get_from_extra_config\(|strict_bool\([^,()]+,)\s*(?:\"([a-z_]+)\"|([A-Z][A-Z0-9_]*))"
)
ENV_USE = re.compile(
    r"(?:os\.environ|\benv)(?:\.get|\.setdefault|\.pop)?\s*[(\[]\s*"
    r"(?:\"([A-Z][A-Z0-9_]+)\"|([A-Z][A-Z0-9_]+)\b)"
)
CONSTANT = re.compile(r"^([A-Z][A-Z0-9_]*)\s*(?::[^=\n]+)?=\s*\"([^\"]+)\"", re.M)


def _sources() -> list[str]:
    return [p.read_text() for p in sorted(PACKAGE.rglob("*.py")) if p != CATALOG]


def _used(pattern: re.Pattern[str]) -> set[str]:
    sources = _sources()
    constants = {name: value for text in sources for name, value in CONSTANT.findall(text)}
    used = set()
    for text in sources:
        for literal, constant in pattern.findall(text):
            used.add(literal or constants.get(constant, f"<unresolved {constant}>"))
    return used


def test_the_reference_pages_are_what_the_code_generates() -> None:
    done = subprocess.run(
        [sys.executable, "scripts/gen_reference.py", "--check"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 0, done.stdout + done.stderr


def test_every_cli_option_says_what_it_means() -> None:
    cli = (ROOT / "docs" / "reference" / "cli.md").read_text()
    rows = [line for line in cli.splitlines() if line.startswith("| `")]
    assert len(rows) > 30
    empty = [row for row in rows if row.replace(" ", "").endswith("||")]
    assert not empty, f"options without help: {empty}"


def test_the_catalog_names_exactly_the_extra_config_keys_the_code_reads() -> None:
    declared = {s.name for s in settings_catalog.EXTRA_CONFIG_KEYS}
    assert _used(EXTRA_READ) == declared


def test_the_catalog_names_exactly_the_environment_variables_the_code_uses() -> None:
    declared = {s.name for s in settings_catalog.ENVIRONMENT}
    used = _used(ENV_USE)
    assert used == declared, (
        f"used, not declared: {sorted(used - declared)}; declared, not used: "
        f"{sorted(declared - used)}"
    )


def test_every_error_our_code_raises_is_in_the_troubleshooting_page() -> None:
    """docs/operations.md explains each exception class the package defines, by name."""
    page = (ROOT / "docs" / "operations.md").read_text()
    declared = set()
    for path in PACKAGE.rglob("*.py"):
        declared.update(
            re.findall(
                r"^class (\w+)\((?:\w+\.)?\w*(?:Error|Exception|Failed)\w*\)",
                path.read_text(),
                re.M,
            )
        )
    assert len(declared) > 20
    missing = sorted(name for name in declared if f"`{name}`" not in page)
    assert not missing, f"errors without a troubleshooting entry in docs/operations.md: {missing}"

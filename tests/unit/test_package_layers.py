"""The package's layers hold: every module imports only its own sub-package and those below it
(``vllm_hybrid_nixl/__init__.py`` names the order), ``protocol`` and ``common`` never import
vLLM, and what a lean install ships (connector, preflight) never imports Ray, FastAPI or
uvicorn. Read from the source with ``ast``, so lazy imports inside functions count too."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

pytestmark = pytest.mark.unit

PACKAGE = Path(__file__).resolve().parents[2] / "vllm_hybrid_nixl"
LAYER = {
    "common": 0,
    "protocol": 1,
    "connector": 2,
    "tools": 2,
    "preflight": 3,
    "router": 3,
    "deploy": 4,
    "cli": 5,
}
# Optional-dependency packages a lean install (no `router`, `ray` or `serve` extra) lacks.
NOT_IN_A_LEAN_INSTALL = ("ray", "fastapi", "uvicorn", "starlette", "prometheus_client")
LEAN = ("common", "protocol", "connector", "preflight")


def sub_package(module: Path) -> str:
    relative = module.relative_to(PACKAGE)
    return relative.parts[0].removesuffix(".py")


def imports(module: Path) -> list[str]:
    tree = ast.parse(module.read_text(), filename=str(module))
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            found += [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            if node.module == "vllm_hybrid_nixl":
                found += [f"vllm_hybrid_nixl.{alias.name}" for alias in node.names]
            else:
                found.append(node.module)
    return found


MODULES = sorted(p for p in PACKAGE.rglob("*.py") if p != PACKAGE / "__init__.py")


def test_every_module_belongs_to_a_layer() -> None:
    assert {sub_package(m) for m in MODULES} <= set(LAYER), "a new sub-package needs a layer"


def test_no_module_imports_a_higher_layer() -> None:
    upward = []
    for module in MODULES:
        own = sub_package(module)
        for name in imports(module):
            parts = name.split(".")
            if parts[0] != "vllm_hybrid_nixl" or len(parts) < 2 or parts[1] not in LAYER:
                continue
            if parts[1] != own and LAYER[parts[1]] >= LAYER[own]:
                upward.append(f"{module.relative_to(PACKAGE)} imports {name}")
    assert upward == []


def test_protocol_and_common_import_no_vllm() -> None:
    found = [
        f"{module.relative_to(PACKAGE)} imports {name}"
        for module in MODULES
        if sub_package(module) in ("protocol", "common")
        for name in imports(module)
        if name.split(".")[0] in ("vllm", "torch")
    ]
    assert found == []


def guarded_imports(module: Path) -> set[str]:
    """Imports inside a ``try`` that handles ImportError: optional by construction."""
    guarded: set[str] = set()
    for node in ast.walk(ast.parse(module.read_text())):
        if not isinstance(node, ast.Try):
            continue
        handled = {
            name.id
            for handler in node.handlers
            for name in ast.walk(handler.type)
            if handler.type is not None
            if isinstance(name, ast.Name)
        }
        if handled & {"ImportError", "ModuleNotFoundError"}:
            for inner in node.body:
                for sub in ast.walk(inner):
                    if isinstance(sub, ast.ImportFrom) and sub.module:
                        guarded.add(sub.module)
                    elif isinstance(sub, ast.Import):
                        guarded.update(alias.name for alias in sub.names)
    return guarded


def test_a_lean_install_needs_no_ray_or_web_server() -> None:
    found = [
        f"{module.relative_to(PACKAGE)} imports {name}"
        for module in MODULES
        if sub_package(module) in LEAN
        for name in imports(module)
        if name.split(".")[0] in NOT_IN_A_LEAN_INSTALL and name not in guarded_imports(module)
    ]
    assert found == []

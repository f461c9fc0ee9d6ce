"""Generate docs/reference/cli.md (from the CLI's argument parsers) and
docs/reference/configuration.md (from vllm_hybrid_nixl/common/settings_catalog.py).

    python scripts/gen_reference.py          write both pages
    python scripts/gen_reference.py --check  exit 1 naming the pages that differ
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PAGES = ROOT / "docs" / "reference"


def _cell(text: str) -> str:
    return " ".join(text.split()).replace("|", "\\|")


def _option_rows(parser: argparse.ArgumentParser) -> list[str]:
    rows = []
    for action in parser._actions:
        if isinstance(action, argparse._HelpAction | argparse._SubParsersAction):
            continue
        names = ", ".join(f"`{name}`" for name in action.option_strings) or f"`{action.dest}`"
        if action.metavar and action.option_strings:
            names += f" `{action.metavar}`"
        default = action.default
        meaning = (action.help or "").replace("%(default)s", str(default))
        if action.choices:
            meaning += " (one of " + ", ".join(f"`{c}`" for c in action.choices) + ")"
        if default not in (None, argparse.SUPPRESS, False, "") and "default" not in meaning:
            meaning += f" (default: `{default}`)"
        if action.required and action.nargs != argparse.REMAINDER:
            meaning += " (required)"
        rows.append(f"| {names} | {_cell(meaning)} |")
    return rows


def cli_reference() -> str:
    from vllm_hybrid_nixl.cli import build_parser

    parser = build_parser()
    lines = [
        "# CLI reference",
        "",
        "Generated from the argument parsers by `python scripts/gen_reference.py`; a test fails",
        "when this page and the parsers differ.",
        "",
    ]
    subparsers = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    helps = {choice.dest: choice.help for choice in subparsers._choices_actions}
    for name, sub in subparsers.choices.items():
        summary = _cell(helps.get(name) or "")
        lines += [f"## `vllm-hybrid-nixl {name}`", "", summary[:1].upper() + summary[1:] + ".", ""]
        if sub.description:
            lines += [_cell(sub.description), ""]
        rows = _option_rows(sub)
        if rows:
            lines += ["| option | meaning |", "|---|---|", *rows, ""]
    return "\n".join(lines).rstrip() + "\n"


def configuration_reference() -> str:
    from vllm_hybrid_nixl.common.settings_catalog import ENVIRONMENT, EXTRA_CONFIG_KEYS

    lines = [
        "# Configuration reference",
        "",
        "Generated from `vllm_hybrid_nixl/common/settings_catalog.py` by",
        "`python scripts/gen_reference.py`; a test fails when the code reads or sets a key that",
        "is not declared there, or a declared key is no longer used.",
        "",
        "## `kv_connector_extra_config` keys (in `--kv-transfer-config`)",
        "",
        "| key | read by | meaning |",
        "|---|---|---|",
        *[f"| `{s.name}` | {_cell(s.used_by)} | {_cell(s.meaning)} |" for s in EXTRA_CONFIG_KEYS],
        "",
        "## Environment variables",
        "",
        "| variable | read or set by | meaning |",
        "|---|---|---|",
        *[f"| `{s.name}` | {_cell(s.used_by)} | {_cell(s.meaning)} |" for s in ENVIRONMENT],
    ]
    return "\n".join(lines) + "\n"


def pages() -> dict[Path, str]:
    return {
        PAGES / "cli.md": cli_reference(),
        PAGES / "configuration.md": configuration_reference(),
    }


def main(argv: list[str]) -> int:
    stale = [
        path for path, text in pages().items() if not path.exists() or path.read_text() != text
    ]
    if "--check" in argv:
        for path in stale:
            print(f"{path.relative_to(ROOT)} is stale: run python scripts/gen_reference.py")
        return 1 if stale else 0
    PAGES.mkdir(parents=True, exist_ok=True)
    for path, text in pages().items():
        path.write_text(text)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))

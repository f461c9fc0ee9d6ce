"""Turn the matrix run's JUnit files into a release x test-file table in README.md.

    python scripts/matrix_report.py matrix README.md
"""

from __future__ import annotations

import sys
import xml.etree.ElementTree as ET
from collections import defaultdict
from pathlib import Path

START, END = "<!-- matrix:start -->", "<!-- matrix:end -->"


def _release_key(release: str) -> tuple[int, ...]:
    return tuple(int(part) for part in release.split("."))


def collect(directory: Path) -> dict[str, dict[str, list[int]]]:
    """release -> test file -> [passed, failed, skipped]."""
    results: dict[str, dict[str, list[int]]] = {}
    for junit in sorted(directory.glob("junit-*.xml")):
        release = junit.stem.removeprefix("junit-")
        per_file: dict[str, list[int]] = defaultdict(lambda: [0, 0, 0])
        for case in ET.parse(junit).getroot().iter("testcase"):
            module = case.get("classname", "").rsplit(".", 1)[0] if "." in case.get(
                "classname", ""
            ) else case.get("classname", "")
            name = module.replace(".", "/") + ".py"
            outcome = {child.tag for child in case}
            if outcome & {"failure", "error"}:
                per_file[name][1] += 1
            elif "skipped" in outcome:
                per_file[name][2] += 1
            else:
                per_file[name][0] += 1
        results[release] = dict(per_file)
    return results


def table(results: dict[str, dict[str, list[int]]]) -> str:
    releases = sorted(results, key=_release_key)
    files = sorted({name for per_file in results.values() for name in per_file})
    lines = ["| test file | " + " | ".join(f"vLLM {r}" for r in releases) + " |"]
    lines.append("|---|" + "---|" * len(releases))
    for name in files:
        cells = []
        for release in releases:
            passed, failed, skipped = results[release].get(name, [0, 0, 0])
            if not passed and not failed and not skipped:
                cells.append("—")
            elif failed:
                cells.append(f"**FAIL** {failed} of {passed + failed}")
            else:
                cells.append(f"pass ({passed}{f', {skipped} skipped' if skipped else ''})")
        lines.append(f"| `{name}` | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def main(directory: str, readme: str) -> int:
    results = collect(Path(directory))
    if not results:
        print(f"no junit-*.xml in {directory}", file=sys.stderr)
        return 1
    text = Path(readme).read_text()
    if START not in text or END not in text:
        print(f"{readme} has no {START} ... {END} section", file=sys.stderr)
        return 1
    head, rest = text.split(START, 1)
    _, tail = rest.split(END, 1)
    Path(readme).write_text(f"{head}{START}\n{table(results)}\n{END}{tail}")
    print(table(results))
    return 0


if __name__ == "__main__":
    sys.exit(main(*sys.argv[1:3]))

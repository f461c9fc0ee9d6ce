"""Turn the matrix run's JUnit files into a release x test-file table in docs/versions.md.

python scripts/matrix_report.py matrix docs/versions.md
"""

from __future__ import annotations

import sys
import xml.etree.ElementTree as ET
from collections import defaultdict
from pathlib import Path

START, END = "<!-- matrix:start -->", "<!-- matrix:end -->"


def _release_key(release: str) -> tuple[int, ...]:
    return tuple(int(part) for part in release.split("."))


def _outcome(case: ET.Element) -> int:
    """0 passed, 1 failed, 2 skipped."""
    tags = {child.tag for child in case}
    if tags & {"failure", "error"}:
        return 1
    return 2 if "skipped" in tags else 0


def collect(directory: Path) -> dict[str, dict[str, list[int]]]:
    """release -> test file -> [passed, failed, skipped].

    ``junit-<release>.xml`` and any later ``junit-<release>.<rerun>.xml`` (a partial rerun,
    ``MATRIX_RERUN=name``): per test case, the newest file wins.
    """
    cases: dict[str, dict[tuple[str, str], int]] = defaultdict(dict)
    for junit in sorted(directory.glob("junit-*.xml"), key=lambda path: path.stat().st_mtime):
        release = junit.name.removeprefix("junit-").removesuffix(".xml")
        release = ".".join(release.split(".")[:3])
        for case in ET.parse(junit).getroot().iter("testcase"):
            classname = case.get("classname", "")
            cases[release][(classname, case.get("name", ""))] = _outcome(case)
    results: dict[str, dict[str, list[int]]] = {}
    for release, outcomes in cases.items():
        per_file: dict[str, list[int]] = defaultdict(lambda: [0, 0, 0])
        for (classname, _), outcome in outcomes.items():
            module = classname.rsplit(".", 1)[0] if classname.count(".") > 2 else classname
            per_file[module.replace(".", "/") + ".py"][outcome] += 1
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

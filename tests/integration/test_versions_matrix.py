"""The docs' version-matrix table (docs/versions.md) stays true to the suite: it names
exactly the files the matrix runs (scripts/matrix-tests.txt), each with as many tests per
release as the suite has now, and one column per release in ``compat.TESTED_RELEASES``.
Adding, removing or renaming a version-sensitive test without rerunning ``make test-matrix``
fails here."""

from __future__ import annotations

import re
import subprocess
import sys
from collections import Counter
from pathlib import Path

from vllm_hybrid_nixl.connector import compat

ROOT = Path(__file__).resolve().parents[2]
START, END = "<!-- matrix:start -->", "<!-- matrix:end -->"
CELL = re.compile(r"(?:pass \((\d+)(?:, (\d+) skipped)?\)|\*\*FAIL\*\* \d+ of (\d+)|—)")


def matrix_paths() -> list[str]:
    lines = (ROOT / "scripts/matrix-tests.txt").read_text().splitlines()
    return [line.strip() for line in lines if line.strip() and not line.startswith("#")]


def docs_table() -> tuple[list[str], dict[str, list[int]]]:
    """(releases, test file -> test count per release) as docs/versions.md states them."""
    text = (ROOT / "docs" / "versions.md").read_text()
    section = text.split(START, 1)[1].split(END, 1)[0]
    rows = [row.strip().strip("|").split("|") for row in section.strip().splitlines()]
    releases = [cell.strip().removeprefix("vLLM ") for cell in rows[0][1:]]
    counts: dict[str, list[int]] = {}
    for row in rows[2:]:
        name = row[0].strip().strip("`")
        per_release = []
        for cell in row[1:]:
            match = CELL.fullmatch(cell.strip())
            assert match, f"docs matrix cell {cell!r} of {name} has an unknown form"
            passed, skipped, of_total = match.groups()
            if of_total:
                per_release.append(int(of_total))
            else:
                per_release.append(int(passed or 0) + int(skipped or 0))
        counts[name] = per_release
    return releases, counts


def collected_counts(paths: list[str]) -> Counter[str]:
    """test file -> number of test cases pytest collects there (parametrised cases each)."""
    done = subprocess.run(
        [sys.executable, "-m", "pytest", "--collect-only", "-q", "-p", "no:cacheprovider", *paths],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    return Counter(line.split("::", 1)[0] for line in done.stdout.splitlines() if "::" in line)


def test_the_matrix_table_names_the_tested_releases() -> None:
    releases, _ = docs_table()
    assert releases == list(compat.TESTED_RELEASES), (
        f"The docs' matrix columns are {releases}, compat.TESTED_RELEASES is "
        f"{compat.TESTED_RELEASES}: run `make test-matrix` on those releases"
    )


def test_the_matrix_table_counts_every_test_the_matrix_runs() -> None:
    _, table = docs_table()
    collected = collected_counts(matrix_paths())
    assert set(table) == set(collected), (
        "The docs' matrix table is stale: files only in the table "
        f"{sorted(set(table) - set(collected))}, only in the suite "
        f"{sorted(set(collected) - set(table))}; run `make test-matrix`"
    )
    stale = {
        name: (counts, collected[name])
        for name, counts in table.items()
        if any(count != collected[name] for count in counts)
    }
    assert not stale, (
        "The docs' matrix table is stale (file: (tests per release in the table, tests now)): "
        f"{stale}; run `make test-matrix`"
    )

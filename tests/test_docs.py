"""The repository's prose describes the product as it is, not how or where it was made: no work sessions,
no words of how GPU machines were lent and their time counted, no authoring tools, no issue numbers, no
result files named by a run (the patterns below). Scanned: the README, docs/, the results index and notes, the tree
presets' README and notes, the shipped head's model card and metadata. Code is not scanned (a Python
``Session`` class or ``start_new_session`` is fine there); neither is benchmark data or model output. In
prose the runtime's ``Session`` may be named as "Session" or in backticks, never as a plain lowercase word."""

from __future__ import annotations

import json
import re
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]

FORBIDDEN = {
    # The runtime's Session class is a product term: written "Session" or in backticks it is allowed.
    "session": re.compile(r"(?<![`./_])\bsessions?\b(?![`(_]|\.py)|\bSessions?\s+\d|\bSESSIONS?\b"),
    "lease": re.compile(r"\blease[sd]?\b", re.I),
    "device time": re.compile(r"\bdevice[- ]time\b", re.I),
    "device tool": re.compile(r"\bdevice tool\b", re.I),
    # the trainer's --time-budget (time_budget) is a product feature; any other budget is machine lending
    "budget": re.compile(r"(?<!time )(?<!time-)(?<!time_)\bbudgets?\b", re.I),
    "agent": re.compile(r"\bagents?\b|\bagentic\b|\bAI assistant\b", re.I),
    "issue number": re.compile(r"(?:\bissues?\s*#?\d+|(?<![\w#&/])#\d+\b)", re.I),
    "run-numbered result file": re.compile(r"_(?:session|run)\d+\.json\b", re.I),
}


def _tracked(*patterns: str) -> list[Path]:
    out = subprocess.run(["git", "ls-files", "--", *patterns], cwd=ROOT, capture_output=True, text=True)
    if out.returncode != 0:
        pytest.skip("not a git checkout")
    return sorted({ROOT / line for line in out.stdout.splitlines() if line})


def _prose_files() -> list[Path]:
    files = _tracked("*.md", "trees/README.md", "docs/*", "fsd_eagle/heads/*/README.md")
    return [f for f in files if f.suffix != ".svg"]  # figures drawn from results (eval/figures.py), not prose


def _json_files() -> list[Path]:
    """Result and preset files: their notes, commands and descriptions (every string in them)."""
    files = _tracked("eval/results/*.json", "eval/results/archive/*.json", "eval/results/sweep/*.json",
                     "fsd_eagle/presets.json",
                     "fsd_eagle/heads/*/*.json", "training/recipes/*.json")
    return [f for f in files if "/raw/" not in f.as_posix()]


def _strings(value, path="$"):
    if isinstance(value, str):
        yield path, value
    elif isinstance(value, dict):
        for k, v in value.items():
            yield f"{path}.{k}", str(k)
            yield from _strings(v, f"{path}.{k}")
    elif isinstance(value, list):
        for i, v in enumerate(value):
            yield from _strings(v, f"{path}[{i}]")


def _hits(text: str) -> list[str]:
    return [f"{name}: {m.group(0)!r}" for name, rx in FORBIDDEN.items() for m in rx.finditer(text)]


def test_the_scan_finds_what_it_must():
    """The patterns catch the history-telling phrases and leave the product's own words alone."""
    for bad in ("what changed since session 6", "one H100 lease", "1,800 s of budget", "device time",
                "the device tool", "an AI agent wrote", "issue #19", "(#6)", "gpu_speed_h100_session5.json",
                "in this session", "Session 3 measured", "two sessions later"):
        assert _hits(bad), bad
    for good in ("--time-budget 440", "a time budget of 850 s", "time_budget_s", "tokens/s", "## 1. heading",
                 "sessionless", "GSM8K's '#### 18' answer format", "####18", "release 5.17", "pleased",
                 "a Session owns the caches", "engine -> plan -> `session` -> round", "gen.session(batch=8)",
                 "fsd_eagle/session.py"):
        assert not _hits(good), good


@pytest.mark.parametrize("path", _prose_files(), ids=lambda p: p.relative_to(ROOT).as_posix())
def test_prose_speaks_of_the_product(path):
    lines = path.read_text(encoding="utf-8").splitlines()
    hits = [f"{path.relative_to(ROOT)}:{i}: {h}" for i, line in enumerate(lines, 1) for h in _hits(line)]
    assert not hits, "\n".join(hits)


@pytest.mark.parametrize("path", _json_files(), ids=lambda p: p.relative_to(ROOT).as_posix())
def test_result_notes_speak_of_the_product(path):
    data = json.loads(path.read_text(encoding="utf-8"))
    hits = [f"{path.relative_to(ROOT)} {where}: {h}" for where, text in _strings(data) for h in _hits(text)]
    assert not hits, "\n".join(hits)


def test_result_files_are_named_by_what_they_measure():
    names = [p.name for p in _tracked("eval/results/*", "eval/results/**/*")]
    assert names and not [n for n in names if re.search(r"session|_run\d|run\d+\b", n, re.I)]


def _table_rows(text: str) -> list[tuple[int, int, int]]:
    """(line, cells, header cells) of each row of each pipe table in ``text``. As GitHub renders tables, every
    pipe not escaped as ``\\|`` ends a cell, inside backticks too."""
    rows, header = [], None
    for number, line in enumerate(text.splitlines(), 1):
        if not line.startswith("|"):
            header = None
            continue
        cells = len(re.split(r"(?<!\\)\|", line.strip())) - 2
        header = cells if header is None else header
        rows.append((number, cells, header))
    return rows


def test_table_rows_count_cells_as_rendered():
    assert _table_rows("| a | b |\n| --- | --- |\n| `x \\| y` | z |\n\n| c |\n| --- |\n") == \
        [(1, 2, 2), (2, 2, 2), (3, 2, 2), (5, 1, 1), (6, 1, 1)]
    assert _table_rows("| a | b |\n| --- | --- |\n| `|p - q|` | z |\n")[2] == (3, 4, 2)


@pytest.mark.parametrize("path", _prose_files(), ids=lambda p: p.relative_to(ROOT).as_posix())
def test_every_table_row_has_its_header_cells(path):
    """A row with more or fewer cells than its header (a pipe inside code not escaped, a row pasted into the
    wrong table) renders as a broken table."""
    bad = [f"{path.relative_to(ROOT)}:{line}: {cells} cells, the header has {header}"
           for line, cells, header in _table_rows(path.read_text(encoding="utf-8")) if cells != header]
    assert not bad, "\n".join(bad)

"""The README as a newcomer reads it: short, every Python example valid code, every command line one that its
command accepts, every link and figure present, every results figure naming the file it comes from, and the
figures what ``python -m eval figures`` draws from the committed results today."""

from __future__ import annotations

import ast
import re
import shlex
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
README = ROOT / "README.md"
MAX_LINES = 350


def text() -> str:
    return README.read_text(encoding="utf-8")


def blocks(language: str) -> list[str]:
    return re.findall(rf"^```{language}\n(.*?)^```", text(), re.S | re.M)


def command_lines(block: str) -> list[str]:
    """The commands of a bash block: continuation lines joined, comments dropped."""
    joined = re.sub(r"\\\n\s*", " ", block)
    return [line.split(" #")[0].strip() for line in joined.splitlines() if line.strip() and not line.startswith("#")]


def test_the_readme_fits_its_line_budget():
    lines = text().count("\n")
    assert lines <= MAX_LINES, f"README.md has {lines} lines (at most {MAX_LINES}: move details to docs/)"


def test_the_readme_sections_come_in_the_newcomers_order():
    heads = [h.lower() for h in re.findall(r"^## (.+)$", text(), re.M)]
    order = ["two commands", "python", "command line", "server", "your own target", "results", "how it works",
             "development"]
    found = [next(i for i, h in enumerate(heads) if h.startswith(name)) for name in order]
    assert found == sorted(found), heads


@pytest.mark.parametrize("index", range(len(blocks("python"))))
def test_python_examples_are_valid_python(index):
    ast.parse(blocks("python")[index])


def test_command_lines_are_accepted_by_their_commands():
    """Every ``fsd-eagle generate``/``serve`` line parses with the CLI's own parser (nothing runs)."""
    from fsd_eagle.cli import _parser

    parser = _parser()
    checked = 0
    for block in blocks("bash"):
        for line in command_lines(block):
            if not line.startswith(("fsd-eagle ", "torchrun ")):
                continue
            words = shlex.split(line)
            if words[:1] == ["torchrun"]:
                words = ["fsd-eagle"] + words[words.index("fsd_eagle.cli") + 1:]
            if words[:2] in (["fsd-eagle", "generate"], ["fsd-eagle", "serve"]):
                parser.parse_args(words[1:])
                checked += 1
    assert checked >= 8


def test_links_and_figures_point_at_files_that_exist():
    targets = re.findall(r"\]\(([^)#\s]+)\)", text())
    missing = [t for t in targets if not t.startswith("http") and not (ROOT / t).exists()]
    assert targets and not missing, missing


def test_every_results_figure_names_its_file():
    section = text().split("\n## Results", 1)[1].split("\n## ", 1)[0]
    rows = [line for line in section.splitlines() if line.startswith("| ") and not line.startswith("| ---")][1:]
    assert len(rows) >= 5
    for row in rows:
        files = re.findall(r"\]\((eval/results/[^)]+)\)", row)
        assert files and all((ROOT / f).is_file() for f in files), row
        assert re.search(r"20\d\d-\d\d-\d\d, [0-9a-f]{7}", row), f"no date and commit: {row}"


def test_the_figures_are_drawn_from_the_committed_results(tmp_path):
    from eval.figures import FIGURES, main

    assert main(["--out", str(tmp_path)]) == 0
    for name in FIGURES:
        drawn = (tmp_path / name).read_text()
        assert drawn.startswith("<svg") and "<polyline" in drawn
        assert drawn == (ROOT / "docs" / "figures" / name).read_text(), f"docs/figures/{name} is stale: python -m eval figures"
        assert f"docs/figures/{name}" in text()


def test_the_figures_command_replaces_only_its_own_files(tmp_path):
    from eval.figures import main

    (tmp_path / "batch_speedup.svg").write_text("<svg>someone else's</svg>")
    assert main(["--out", str(tmp_path)]) == 2
    assert (tmp_path / "batch_speedup.svg").read_text() == "<svg>someone else's</svg>"
    assert not (tmp_path / "fsd_tradeoff.svg").exists()

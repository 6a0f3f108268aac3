"""The rows of the speed benchmark: how a row is named and chosen (``--rows``), which trees and sampling settings
make rows; shared by eval/speed.py and the warm-up processes it starts (eval/warm.py)."""

from __future__ import annotations

import fnmatch


def parse_trees(text: str | None) -> list:
    """``--trees``: "64/6/8/v16384,96/6/12" -> TreeConfigs (a one-line error for a malformed item)."""
    from fsd_eagle.config import TreeConfig
    from fsd_eagle.errors import ConfigError

    if not text:
        return []
    try:
        return TreeConfig.parse_list(text)
    except ConfigError as e:
        raise SystemExit(f"error: --trees: {e}") from None


def _label(row: dict, with_tree: bool = False) -> str:
    """A row's unique name: method (with divergence and threshold for FSD), the tree when the run names its
    trees (``--trees``; ``with_tree``), backend, and the sampling settings when not greedy, e.g. ``eagle2_compiled``,
    ``fsd_kl_T1_graph_t0.7_p0.9``, ``eagle2_96-6-12-v16384_compiled_t0.7``."""
    name = row["method"] if row["method"] != "fsd" else f"fsd_{row['divergence']}_T{row['threshold']:g}"
    if with_tree and row.get("tree") not in (None, "ar"):
        name += "_" + row["tree"].replace("/", "-")
    name += f"_{row['backend']}" if row["backend"] != "hf" else ""
    if row.get("temperature"):
        name += f"_t{row['temperature']:g}" + (f"_p{row['top_p']:g}" if row.get("top_p", 1.0) < 1.0 else "")
    if row.get("children", "top") != "top":
        name += f"_{row['children']}"
    return name


def row_wanted(patterns: list[str], row: dict, with_tree: bool = False) -> bool:
    """Whether a row (its method, divergence, threshold, backend, sampling settings and tree) is one that
    ``--rows`` asks for: its name (``_label``) matches one of the glob ``patterns``; every row without any."""
    name = _label(row, with_tree)
    return not patterns or any(fnmatch.fnmatchcase(name, pattern) for pattern in patterns)


def row_patterns(text: str) -> list[str]:
    """``--rows``: comma-separated glob patterns (empty: every row)."""
    return [x.strip() for x in text.split(",") if x.strip()]


def sampling_rows(method: str, temperatures: list[float], children: list[str]) -> list[tuple[float, str]]:
    """The (temperature, children) of a method's rows, in order: each temperature, and when a drafting method
    samples, each kind of children (plain decoding and greedy rows have none to choose)."""
    return [(t, c) for t in temperatures for c in (children if t and method != "ar" else ["top"])]

"""What a benchmark file records about its run, and how it is written.

``git_commit`` and ``versions`` fill a result file's header (which code, which libraries); ``write_json_atomic``
replaces a result file in one step, so that a run killed while writing leaves the previous complete file
rather than a cut-off one.
"""

from __future__ import annotations

import json
import platform
import subprocess
from pathlib import Path

from fsd_eagle.jsonl import write_text_atomic

ROOT = Path(__file__).resolve().parents[1]


def git_commit(short: bool = False) -> str | None:
    """The checkout's HEAD commit (abbreviated with ``short``); outside a git checkout, the commit named by a
    ``COMMIT`` file at the top of the code (a GPU host's copy of the code, eval/device/job.sh), else None."""
    cmd = ["git", "-C", str(ROOT), "rev-parse", *(["--short"] if short else []), "HEAD"]
    try:
        out = subprocess.run(cmd, capture_output=True, text=True, timeout=10)
        if out.returncode == 0 and out.stdout.strip():
            return out.stdout.strip()
    except (OSError, subprocess.SubprocessError):
        pass
    try:
        named = (ROOT / "COMMIT").read_text(encoding="utf-8").strip().split()
    except OSError:
        return None
    return named[0] if named else None


def dist_version(name: str) -> str | None:
    """The installed version of distribution ``name``, or None when it is not installed."""
    try:
        from importlib.metadata import version

        return version(name)
    except Exception:  # noqa: BLE001 (not installed: no version)
        return None


def versions() -> dict:
    """Versions of torch, transformers, fsd_eagle and Python."""
    import torch
    import transformers

    import fsd_eagle

    return {"torch": torch.__version__, "transformers": transformers.__version__,
            "fsd_eagle": getattr(fsd_eagle, "__version__", None) or dist_version("fsd-eagle"),
            "python": platform.python_version()}


def write_json_atomic(path: Path | str, obj, indent: int | None = 2, default=None) -> Path:
    """Write ``obj`` as JSON to ``path`` through a temporary file in the same folder and ``os.replace``:
    readers (and a later resume) see either the old file or the new one, never a partial write. Refuses
    NaN and infinity, which are not JSON; ``default`` as in ``json.dumps`` (e.g. ``str`` for paths)."""
    return write_text_atomic(path, json.dumps(obj, indent=indent, allow_nan=False, default=default) + "\n")

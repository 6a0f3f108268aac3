"""The suite leaves the checkout as it found it: no test may change, add or delete a file of the repository
(a command under test that writes its default output path into the tree, say). ``tests/conftest.py`` takes
``checkout_state`` when the run starts and reports ``changes`` when it ends, failing the run on any.

The state is what ``git status`` lists (changed, new and ignored paths, untracked and ignored folders as one
entry each) with a digest of each listed file's content, so a file that was already changed before the run
and is changed again is caught too. Caches that Python and the test tools write while the suite runs
(``SCRATCH``) are left out.
"""

from __future__ import annotations

import hashlib
import shutil
import subprocess
from pathlib import Path

SCRATCH = ("__pycache__", ".pytest_cache", ".hypothesis")
UNTRACKED = ("??", "!!")  # git's status codes of new and ignored paths


def checkout_state(root: Path) -> dict[str, tuple[str, str]] | None:
    """Each path that ``git status --ignored`` lists under ``root`` (relative, as git writes it), mapped to its
    two-letter status and a digest of its content ("folder" for a folder, "gone" for a deleted file); None where
    ``root`` is not a git checkout or git is missing."""
    if shutil.which("git") is None:
        return None
    listed = subprocess.run(["git", "-C", str(root), "status", "--porcelain=v1", "-z", "--ignored"],
                            capture_output=True)
    if listed.returncode != 0:
        return None
    entries = listed.stdout.decode("utf-8", "surrogateescape").split("\0")
    state: dict[str, tuple[str, str]] = {}
    skip_next = False
    for entry in entries:
        if skip_next or not entry:  # a rename's second field (its old path) follows it
            skip_next = False
            continue
        status, path = entry[:2], entry[3:]
        skip_next = "R" in status or "C" in status
        if any(part in SCRATCH for part in Path(path).parts):
            continue
        state[path] = (status, _digest(root / path))
    return state


def changes(before: dict[str, tuple[str, str]], after: dict[str, tuple[str, str]]) -> list[str]:
    """The paths whose state differs between two ``checkout_state`` results, each with what happened."""
    out = []
    for path in sorted(set(before) | set(after)):
        if path in before and path in after and before[path][1] == after[path][1]:
            continue
        if path not in after:  # no longer listed: an untracked path removed, or a changed file put back
            what = "deleted" if before[path][0] in UNTRACKED else "restored to the committed file"
        elif after[path][1] == "gone":
            what = "deleted"
        else:
            what = "new" if path not in before and after[path][0] in UNTRACKED else "changed"
        out.append(f"{path} ({what})")
    return out


def _digest(path: Path) -> str:
    if path.is_dir():
        return "folder"
    if not path.exists():
        return "gone"
    return hashlib.sha256(path.read_bytes()).hexdigest()

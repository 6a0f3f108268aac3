"""The suite's check that it leaves the checkout as it found it (tests/checkout_guard.py), on a scratch git
repository: every kind of change a test could make is reported, Python's caches are not."""

from __future__ import annotations

import shutil
import subprocess

import pytest

from checkout_guard import changes, checkout_state

pytestmark = pytest.mark.skipif(shutil.which("git") is None, reason="needs git")


def _repo(root):
    def git(*args):
        subprocess.run(["git", "-C", str(root), *args], check=True, capture_output=True)

    git("init", "-q")
    (root / ".gitignore").write_text("/runs/\n__pycache__/\n")
    (root / "kept.txt").write_text("committed\n")
    (root / "edited.txt").write_text("committed\n")
    (root / "old name.txt").write_text("moved\n")
    git("add", ".")
    git("-c", "user.name=t", "-c", "user.email=t@t", "commit", "-qm", "start")
    (root / "edited.txt").write_text("a change made before the run\n")
    git("mv", "old name.txt", "new name.txt")
    return root


def test_every_change_to_the_checkout_is_reported_and_caches_are_not(tmp_path):
    root = _repo(tmp_path)
    before = checkout_state(root)
    assert before is not None and "edited.txt" in before and "new name.txt" in before
    assert checkout_state(root) == before and changes(before, checkout_state(root)) == []

    (root / "__pycache__").mkdir()
    (root / "__pycache__" / "m.cpython-311.pyc").write_bytes(b"\0")
    assert changes(before, checkout_state(root)) == []  # Python's own cache

    (root / "kept.txt").write_text("overwritten by a test\n")
    (root / "edited.txt").write_text("changed again by a test\n")
    (root / "new name.txt").unlink()
    (root / "out.json").write_text("{}")
    (root / "runs").mkdir()
    (root / "runs" / "head").write_text("x")
    assert changes(before, checkout_state(root)) == [
        "edited.txt (changed)", "kept.txt (changed)", "new name.txt (deleted)", "out.json (new)", "runs/ (new)"]


def test_a_change_that_restores_the_committed_file_or_removes_a_new_file_is_reported(tmp_path):
    root = _repo(tmp_path)
    (root / "notes.txt").write_text("not added yet\n")
    before = checkout_state(root)
    (root / "edited.txt").write_text("committed\n")
    (root / "notes.txt").unlink()
    assert changes(before, checkout_state(root)) == ["edited.txt (restored to the committed file)",
                                                     "notes.txt (deleted)"]


def test_outside_a_git_checkout_there_is_no_state(tmp_path):
    assert checkout_state(tmp_path) is None

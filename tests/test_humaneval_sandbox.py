"""HumanEval scoring against candidates that try to game or escape it (docs/hardening.md, item 5): a wrong
program must not pass whatever it prints, sets or returns; a process that leaves the group with setsid()
must not outlive the check; a fork bomb must be capped and killed; correct programs still pass. Each check
runs twice where it matters: with the isolation this machine allows, and with namespaces off (the fallback).
Fast (about 0.1-0.2 s a check, 2 s for the time-outs) and safe on a small machine: the bomb stops itself at
200 processes should no cap hold, and the test skips when no process cap is active."""

from __future__ import annotations

import fcntl
import gzip
import json
import os
import shutil
import sys
import tempfile
import time
from pathlib import Path

import pytest

import eval.humaneval_exec as he
from eval.humaneval_exec import NPROC, check_program, protections
from eval.tasks import load_humaneval

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="process isolation needs Linux")

WRONG = "    return not True\n"  # HumanEval/0 (has_close_elements) has cases of both answers


@pytest.fixture(scope="module")
def problem():
    return load_humaneval(limit=1)[0]


@pytest.fixture(params=["available", "no namespaces"])
def isolation(request, monkeypatch):
    """The isolation this machine allows, or the fallback without ``unshare``."""
    if request.param == "no namespaces":
        monkeypatch.setattr(he, "_isolation", lambda: ((), (), False))
    return request.param


@pytest.fixture
def scratch():
    """A folder every user id may use (the candidate may run under another one), with a lock file that a
    candidate's processes hold while they live, and a counter file they append to."""
    folder = Path(tempfile.mkdtemp(prefix="fsd_sandbox_test_"))
    folder.chmod(0o777)
    for name in ("lock", "count"):
        (folder / name).touch()
        (folder / name).chmod(0o666)
    yield folder
    for _ in range(50):  # clean up should a test have failed (a capped bomb may still be forking)
        for pid in holders(folder / "lock"):
            try:
                os.kill(pid, 9)
            except OSError:
                pass
        time.sleep(0.02)
    shutil.rmtree(folder, ignore_errors=True)


def holders(path: Path) -> list[int]:
    """Processes that hold ``path`` open (seen from here: also those in a PID namespace)."""
    found = []
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            if any(os.readlink(f"/proc/{pid}/fd/{fd}") == str(path) for fd in os.listdir(f"/proc/{pid}/fd")):
                found.append(int(pid))
        except OSError:
            pass
    return found


def assert_nothing_survived(lock: Path) -> None:
    """Every process of the candidate is gone: none holds the lock file, and its lock is free."""
    assert holders(lock) == []
    fd = os.open(lock, os.O_RDONLY)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)  # raises BlockingIOError while a holder lives
    finally:
        os.close(fd)


def run(problem, body: str, scratch: Path | None = None, timeout_s: float = 5.0):
    if scratch is not None:
        body = body.replace("@LOCK@", repr(str(scratch / "lock"))).replace("@COUNT@", repr(str(scratch / "count")))
    return check_program(problem.prompt + body, problem.test, problem.entry_point, timeout_s=timeout_s)


GAMES = {
    "prints the old pass token and exits 0": WRONG + (
        "import __main__, os, sys\nsys.stdout.write('\\n' + str(getattr(__main__, 'token', '')) + '\\n')\n"
        "sys.stdout.flush()\nos._exit(0)\n"),
    "prints a passed result line": WRONG + (
        "import json, os\nline = json.dumps({'passed': True, 'status': 'passed', 'protections': []})\n"
        "for fd in range(1, 20):\n    try:\n        os.write(fd, ('\\n' + line + '\\n').encode())\n"
        "    except OSError:\n        pass\n"),
    "writes a passed line into the harness's stdout": WRONG + (
        "import json, os\nline = ('\\n' + json.dumps({'passed': True, 'status': 'passed'}) + '\\n').encode()\n"
        "for pid in filter(str.isdigit, os.listdir('/proc')):\n    try:\n"
        "        if b'humaneval_sandbox.py\\0harness' in open(f'/proc/{pid}/cmdline', 'rb').read():\n"
        "            fd = os.open(f'/proc/{pid}/fd/1', os.O_WRONLY)\n            os.write(fd, line)\n"
        "    except OSError:\n        pass\n"),
    "sets pass variables and exits 0": WRONG + (
        "import builtins, os\npassed = PASSED = True\nbuiltins.passed = True\nprint('passed')\nos._exit(0)\n"),
    "returns an always-equal object": (
        "    class Yes(int):\n        def __eq__(self, other): return True\n        def __bool__(self): return True\n"
        "    return Yes(0)\n"),
    "returns a bool subclass of its own": (
        "    class Yes:\n        __eq__ = lambda self, other: True\n    return Yes()\n"),
    "disables assert through builtins": WRONG + "import builtins\nbuiltins.AssertionError = type('X', (Exception,), {})\n",
    "exits 0 from inside the function": "    import os\n    os._exit(0)\n",
    "raises SystemExit(0) inside the function": "    raise SystemExit(0)\n",
}


@pytest.mark.parametrize("game", list(GAMES))
def test_a_wrong_program_cannot_report_itself_passed(problem, isolation, game):
    passed, status = run(problem, GAMES[game])
    assert not passed and status.startswith("failed"), status


def test_a_correct_program_passes(problem, isolation):
    body = "    s = sorted(numbers)\n    return any(b - a < threshold for a, b in zip(s, s[1:]))\n"
    assert run(problem, body) == (True, "passed")


def test_a_setsid_child_does_not_outlive_the_check(problem, isolation, scratch):
    """The child leaves the process group and session (a group kill misses it) and sleeps forever."""
    body = WRONG + ("import fcntl, os, time\nr, w = os.pipe()\nif os.fork() == 0:\n    os.setsid()\n"
                    "    fd = os.open(@LOCK@, os.O_RDONLY)\n    fcntl.flock(fd, fcntl.LOCK_EX)\n"
                    "    os.write(w, b'x')\n    while True:\n        time.sleep(0.2)\nos.read(r, 1)\n")
    passed, status = run(problem, body, scratch)
    assert not passed and status.startswith("failed: AssertionError"), status
    assert_nothing_survived(scratch / "lock")


def test_a_setsid_child_is_killed_at_the_timeout(problem, isolation, scratch):
    body = ("    import fcntl, os, time\n    if os.fork() == 0:\n        os.setsid()\n"
            "        fd = os.open(@LOCK@, os.O_RDONLY)\n        fcntl.flock(fd, fcntl.LOCK_EX)\n"
            "        while True:\n            time.sleep(0.2)\n    while True:\n        time.sleep(0.2)\n")
    start = time.monotonic()
    assert run(problem, body, scratch, timeout_s=1.5) == (False, "timed out")
    assert time.monotonic() - start < 5
    assert_nothing_survived(scratch / "lock")


def test_a_fork_bomb_is_capped_and_killed(problem, isolation, scratch):
    if isolation == "no namespaces":
        he._protections.cache_clear()
    active = protections()
    he._protections.cache_clear()
    if not any("processes" in p or "RLIMIT_NPROC" in p for p in active):
        pytest.skip(f"no process cap is active here ({', '.join(active)})")
    body = WRONG + ("import fcntl, os, time\nfd = os.open(@LOCK@, os.O_RDONLY)\nfcntl.flock(fd, fcntl.LOCK_EX)\n"
                    "c = os.open(@COUNT@, os.O_WRONLY | os.O_APPEND)\n"
                    "while os.fstat(c).st_size < 200:\n    try:\n        if os.fork() == 0:\n"
                    "            os.write(c, b'x')\n    except OSError:\n        time.sleep(0.05)\n"
                    "while True:\n    time.sleep(0.2)\n")
    start = time.monotonic()
    assert run(problem, body, scratch, timeout_s=2.0) == (False, "timed out")
    assert time.monotonic() - start < 6
    assert 0 < (scratch / "count").stat().st_size < NPROC  # forks counted: capped well below the bomb's 200
    assert_nothing_survived(scratch / "lock")


def test_protections_name_the_active_isolation(isolation):
    he._protections.cache_clear()
    active = protections()
    he._protections.cache_clear()
    assert "subreaper kill of every descendant" in active and "address space limit" in active
    assert ("PID namespace" in active) == (isolation == "available" and bool(he._isolation()[0]))


@pytest.mark.parametrize("task", ["HumanEval/32", "HumanEval/33", "HumanEval/38", "HumanEval/50"])
def test_tests_that_call_other_functions_of_the_program_still_work(task):
    """These tests also call the prompt's helpers (poly, encode_cyclic, ...), which run in the candidate."""
    path = Path(__file__).resolve().parents[1] / "eval" / "data" / "humaneval" / "HumanEval.jsonl.gz"
    p = next(json.loads(line) for line in gzip.open(path, "rt") if json.loads(line)["task_id"] == task)
    assert check_program(p["prompt"] + p["canonical_solution"], p["test"], p["entry_point"]) == (True, "passed")
    wrong = p["prompt"] + "    return None\n"
    assert not check_program(wrong, p["test"], p["entry_point"])[0]

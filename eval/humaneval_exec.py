"""Run HumanEval candidate programs against their tests, each in processes of its own.

Candidate code is model output: it never runs in this process, nor in the process that scores it. A check
starts a harness (eval/humaneval_sandbox.py, ``python -I``) that runs the dataset's test code itself and
calls the candidate's functions in a second, fresh process over a pipe, where arguments and return values
cross as plain data only. The check passes only when the harness exits with status 0 and its one result
line says so; the candidate can reach neither (see eval/humaneval_sandbox.py), so a wrong program cannot
report itself as passed, whatever it prints, sets or exits with.

Nothing the candidate starts outlives the check: the harness is a child subreaper (every descendant stays
its own, ``setsid()`` included) and kills them all when the check ends or its wall-clock ``timeout_s`` is
up. The candidate runs in a new empty temporary directory with a minimal environment and limits set before
its program is compiled: address space (``memory_mb``), CPU time, written file size (32 MiB), no core dumps,
and a cap of 32 processes. What enforces each depends on the machine (``protections()`` lists what is
active here):

* ``unshare`` works: a PID namespace (when its first process ends, the kernel kills the rest) and no network;
  not as root, also a user namespace, in which RLIMIT_NPROC counts only the namespace's processes;
* as root (which RLIMIT_NPROC does not bind): a cgroup of its own whose pids controller caps the processes,
  where the cgroup file system lets us make one;
* otherwise (not root, no namespaces): RLIMIT_NPROC set to the user's current process count + 32.

This contains crashes, hangs, fork bombs, memory blow-ups and escapes from the process group of ordinary or
misbehaving model output; it is not a hardened sandbox against deliberately hostile code (without namespaces
the candidate can read what its user can read). Needs Linux for the full set; elsewhere the process group is
killed and the resource limits that exist apply.
"""

from __future__ import annotations

import functools
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
from collections.abc import Iterable, Sequence
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from fsd_eagle.errors import InputError

__all__ = ["check_program", "run_many", "protections", "PASSED", "TIMED_OUT"]

PASSED = "passed"
TIMED_OUT = "timed out"

SANDBOX = Path(__file__).with_name("humaneval_sandbox.py")
NPROC = 32  # processes a candidate may have at once, itself included
_FILE_LIMIT_BYTES = 32 * 1024 * 1024
_HARNESS_GRACE_S = 15.0  # the harness enforces timeout_s itself; this is the backstop for the harness


def check_program(
    program: str,
    test: str,
    entry_point: str,
    timeout_s: float = 5.0,
    memory_mb: int = 1024,
) -> tuple[bool, str]:
    """Run ``test`` + ``check(entry_point)`` against ``program`` in sandboxed processes (module docstring).

    Returns ``(passed, status)`` where status is "passed", "timed out" (the wall-clock ``timeout_s`` or the
    CPU limit ran out) or "failed: <short reason>", e.g. "failed: AssertionError (test line 12: assert
    candidate([1.0, 2.0], 0.5) == True)", "failed: ValueError: bad input (line 9: raise ValueError(...))" or
    "failed: MemoryError" (more than ``memory_mb`` MiB of address space requested).
    """
    if not entry_point.isidentifier():
        raise InputError(f"entry_point must be a Python name, got {entry_point!r}")
    if not timeout_s > 0:
        raise InputError(f"timeout_s must be positive, got {timeout_s!r}")
    if memory_mb <= 0:
        raise InputError(f"memory_mb must be positive, got {memory_mb!r}")
    return _report(program, test, entry_point, timeout_s, memory_mb)[:2]


def protections() -> list[str]:
    """What contains a candidate on this machine, as the harness and the candidate process report it for a
    trivial check (e.g. "PID namespace", "own user id", "at most 32 processes", "subreaper kill of every
    descendant")."""
    return list(_protections())


@functools.lru_cache(maxsize=1)
def _protections() -> tuple[str, ...]:
    return tuple(_report("def f():\n    return 1\n", "def check(c):\n    assert c() == 1\n", "f", 30.0, 512)[2])


def _report(program: str, test: str, entry_point: str, timeout_s: float, memory_mb: int) -> tuple[bool, str, list]:
    """(passed, status, protections) of one check."""
    wrap, wrap_protections, userns = _isolation()
    with tempfile.TemporaryDirectory(prefix="fsd_humaneval_", ignore_cleanup_errors=True) as tmp:
        root = Path(tmp)
        work = root / "work"
        work.mkdir()
        (root / "candidate.py").write_text(program, encoding="utf-8")
        (root / "test.py").write_text(test, encoding="utf-8")
        job = {"program": str(root / "candidate.py"), "test": str(root / "test.py"), "entry_point": entry_point,
               "timeout_s": float(timeout_s), "memory": memory_mb * 1024 * 1024, "cpu": int(timeout_s) + 2,
               "fsize": _FILE_LIMIT_BYTES, "nproc": _nproc_limit(userns), "wrap": list(wrap),
               "cgroup_pids": NPROC,
               "wrap_protections": list(wrap_protections), "userns": userns, "work": str(work),
               "out": str(root / "stdout.txt"), "err": str(root / "stderr.txt")}
        env = {"PATH": os.environ.get("PATH", "/usr/bin:/bin"), "LANG": "C.UTF-8"}
        result = root / "result.txt"  # a file, read from its end: nothing written into it can fill our memory
        with open(result, "wb") as out:
            harness = subprocess.Popen([sys.executable, "-I", str(SANDBOX), "harness", json.dumps(job)],
                                       stdin=subprocess.DEVNULL, stdout=out, stderr=subprocess.DEVNULL, cwd=tmp,
                                       env=env, start_new_session=True, close_fds=True)
        try:
            harness.wait(timeout=timeout_s + _HARNESS_GRACE_S)
        except subprocess.TimeoutExpired:
            return False, TIMED_OUT, list(wrap_protections)
        finally:
            _kill_group(harness.pid)
            harness.wait()
        return _verdict(harness.returncode, _tail(result))


def _tail(path: Path, size: int = 16384) -> bytes:
    with open(path, "rb") as f:
        f.seek(0, os.SEEK_END)
        f.seek(max(0, f.tell() - size))
        return f.read()


def _verdict(returncode: int, out: bytes) -> tuple[bool, str, list]:
    """Passed only with exit status 0 and a last stdout line that says so (the harness's own line)."""
    lines = out.decode("utf-8", "replace").strip().splitlines()
    try:
        result = json.loads(lines[-1]) if lines else {}
    except json.JSONDecodeError:
        result = {}
    if not isinstance(result, dict) or not isinstance(result.get("status"), str):
        return False, f"failed: the harness ended without a result (exit status {returncode})", []
    passed = returncode == 0 and result.get("passed") is True and result["status"] == PASSED
    status = result["status"] if passed or result["status"] != PASSED else "failed: inconsistent harness result"
    return passed, status, list(result.get("protections") or [])


@functools.lru_cache(maxsize=1)
def _isolation() -> tuple[tuple[str, ...], tuple[str, ...], bool]:
    """(command prefix, protections it adds, whether it is a user namespace): ``unshare`` with a PID
    namespace and no network where that works on this machine (probed once), else nothing."""
    unshare = shutil.which("unshare")
    if unshare is None or not sys.platform.startswith("linux"):
        return (), (), False
    root = os.geteuid() == 0
    base = [unshare] + ([] if root else ["--user", "--map-root-user"])
    added = [] if root else ["user namespace"]
    for extra, names in ((["--net"], ["PID namespace", "no network"]), ([], ["PID namespace"])):
        command = [*base, "--pid", "--fork", "--kill-child", *extra]
        try:
            probe = subprocess.run([*command, sys.executable, "-I", "-c", "pass"], capture_output=True, timeout=20)
        except (OSError, subprocess.SubprocessError):
            continue
        if probe.returncode == 0:
            return tuple(command), tuple(names + added), not root
    return (), (), False


def _nproc_limit(userns: bool) -> int:
    """RLIMIT_NPROC for the candidate: NPROC in a user namespace (which counts its own processes), else this
    user's current process count + NPROC (its other processes count too); 0 for root, which it does not bind."""
    if userns:
        return NPROC
    if os.geteuid() == 0:
        return 0  # root ignores the limit
    mine = 0
    for entry in os.listdir("/proc") if os.path.isdir("/proc") else ():
        try:
            if entry.isdigit() and os.stat(f"/proc/{entry}").st_uid == os.getuid():
                mine += 1
        except OSError:
            pass
    return mine + NPROC


def _kill_group(pgid: int) -> None:
    try:
        os.killpg(pgid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass


def run_many(
    jobs: Iterable[tuple[str, str, str]] | Sequence[tuple[str, str, str]],
    timeout_s: float = 5.0,
    memory_mb: int = 1024,
    workers: int | None = None,
) -> list[tuple[bool, str]]:
    """:func:`check_program` for each ``(program, test, entry_point)``, a few at a time.

    Runs up to ``workers`` checks at once (default: min(4, CPU count)) from a small thread pool; returns the
    results in the order of ``jobs``.
    """
    jobs = list(jobs)
    if workers is None:
        workers = min(4, os.cpu_count() or 1)
    if workers < 1:
        raise InputError(f"workers must be at least 1, got {workers!r}")
    if not jobs:
        return []
    with ThreadPoolExecutor(max_workers=min(workers, len(jobs))) as pool:
        futures = [
            pool.submit(check_program, program, test, entry_point, timeout_s, memory_mb)
            for program, test, entry_point in jobs
        ]
        return [f.result() for f in futures]

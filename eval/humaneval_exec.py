"""Run HumanEval candidate programs against their tests, each in its own subprocess.

Candidate code is model output: it is never executed in this process. Each check runs

    <program>  +  <test>  +  check(<entry_point>)

in a fresh ``python -I`` (``sys.executable``) child, in a new empty temporary directory
that is deleted afterwards, with a minimal environment, and with limits set inside the
child before the candidate code is compiled: address space (``RLIMIT_AS``, ``memory_mb``),
CPU time (``RLIMIT_CPU``, a little above the timeout), size of written files
(``RLIMIT_FSIZE``, 32 MiB) and no core dumps. The child is the leader of a new process
group; the whole group is killed with SIGKILL when the wall-clock timeout expires (and
after a normal exit, to reap anything the candidate left running).

A child passes only if the test code returned *and* the child then printed a random token
it read from stdin before running the candidate, so a candidate that calls
``sys.exit(0)`` or ``os._exit(0)`` before the tests finish fails.

This isolates crashes, hangs and memory blow-ups of ordinary model output; it is not a
security sandbox against deliberately hostile code (the child runs as the same user with
network and filesystem access). Resource limits need a POSIX system (Linux).
"""

from __future__ import annotations

import os
import secrets
import signal
import subprocess
import sys
import tempfile
from collections.abc import Iterable, Sequence
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from fsd_eagle.errors import InputError

__all__ = ["check_program", "run_many", "PASSED", "TIMED_OUT"]

PASSED = "passed"
TIMED_OUT = "timed out"

_FILE_LIMIT_BYTES = 32 * 1024 * 1024
_FAIL_MARK = "__FSD_HUMANEVAL_FAILED__ "
_REASON_CHARS = 200

# The child's bootstrap, run with `python -I -c`. argv: program path, memory bytes, CPU s.
# It sets the limits, reads the pass token from stdin, then compiles and runs the program.
_RUNNER = r"""
import os, sys, traceback
try:
    import resource
except ImportError:
    resource = None

def _limit(name, soft, hard):
    which = getattr(resource, name, None)
    if which is None:
        return
    try:
        _, current = resource.getrlimit(which)
        if current != resource.RLIM_INFINITY:
            soft, hard = min(soft, current), min(hard, current)
        resource.setrlimit(which, (soft, hard))
    except (ValueError, OSError):
        pass

path, memory, cpu = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
if resource is not None:
    _limit("RLIMIT_AS", memory, memory)
    _limit("RLIMIT_CPU", cpu, cpu + 1)
    _limit("RLIMIT_FSIZE", %(fsize)d, %(fsize)d)
    _limit("RLIMIT_CORE", 0, 0)
token = sys.stdin.readline().strip()
sys.stdin.close()
sys.stdin = open(os.devnull)
with open(path, encoding="utf-8") as f:
    source = f.read()
sys.argv = [path]
namespace = {"__name__": "__main__", "__file__": path, "__builtins__": __builtins__}
try:
    exec(compile(source, path, "exec"), namespace)
except BaseException as exc:
    try:
        reason = type(exc).__name__
        text = exc.msg if isinstance(exc, SyntaxError) and exc.msg else str(exc)
        message = " ".join(text.split())
        if message:
            reason += ": " + message[:120]
        lines = source.splitlines()
        if isinstance(exc, SyntaxError) and exc.lineno:
            reason += " (line %%d)" %% exc.lineno
        else:
            frames = [fr for fr in traceback.extract_tb(exc.__traceback__) if fr.filename == path]
            if frames and frames[-1].lineno and frames[-1].lineno <= len(lines):
                code = lines[frames[-1].lineno - 1].strip()[:80]
                reason += " (line %%d: %%s)" %% (frames[-1].lineno, code)
    except BaseException:
        reason = "exception"
    try:
        sys.stdout.flush()
    except BaseException:
        pass
    os.write(2, ("\n" + %(mark)r + reason.replace("\n", " ") + "\n").encode("utf-8", "replace"))
    os._exit(1)
try:
    sys.stdout.flush()
    sys.stderr.flush()
except BaseException:
    pass
os.write(1, ("\n" + token + "\n").encode())
os._exit(0)
""" % {"fsize": _FILE_LIMIT_BYTES, "mark": _FAIL_MARK}


def _tail(path: Path, size: int = 4096) -> str:
    try:
        with open(path, "rb") as f:
            f.seek(0, os.SEEK_END)
            f.seek(max(0, f.tell() - size))
            return f.read().decode("utf-8", "replace")
    except OSError:
        return ""


def _kill_group(pgid: int) -> None:
    try:
        os.killpg(pgid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass


def _signal_name(number: int) -> str:
    try:
        return signal.Signals(number).name
    except ValueError:
        return f"signal {number}"


def check_program(
    program: str,
    test: str,
    entry_point: str,
    timeout_s: float = 5.0,
    memory_mb: int = 1024,
) -> tuple[bool, str]:
    """Run ``program`` + ``test`` + ``check(entry_point)`` in a sandboxed child process.

    Returns ``(passed, status)`` where status is "passed", "timed out" (the wall-clock
    ``timeout_s`` or the CPU limit ran out) or "failed: <short reason>", e.g.
    "failed: AssertionError (line 31: assert candidate([1.0, 2.0], 0.5) == True)" or
    "failed: MemoryError" (more than ``memory_mb`` MiB of address space requested).
    """
    if not entry_point.isidentifier():
        raise InputError(f"entry_point must be a Python name, got {entry_point!r}")
    if not timeout_s > 0:
        raise InputError(f"timeout_s must be positive, got {timeout_s!r}")
    if memory_mb <= 0:
        raise InputError(f"memory_mb must be positive, got {memory_mb!r}")

    source = f"{program}\n\n{test}\n\ncheck({entry_point})\n"
    token = secrets.token_hex(16)
    cpu_s = int(timeout_s) + 2
    env = {"PATH": os.environ.get("PATH", "/usr/bin:/bin"), "LANG": "C.UTF-8"}

    with tempfile.TemporaryDirectory(prefix="fsd_humaneval_", ignore_cleanup_errors=True) as tmp:
        work = Path(tmp)
        program_path = work / "candidate.py"
        program_path.write_text(source, encoding="utf-8")
        out_path, err_path = work / "stdout.txt", work / "stderr.txt"
        env["HOME"] = env["TMPDIR"] = tmp
        with open(out_path, "wb") as out, open(err_path, "wb") as err:
            proc = subprocess.Popen(
                [sys.executable, "-I", "-c", _RUNNER, str(program_path), str(memory_mb * 1024 * 1024), str(cpu_s)],
                stdin=subprocess.PIPE,
                stdout=out,
                stderr=err,
                cwd=tmp,
                env=env,
                start_new_session=True,  # own process group, so killpg reaches its children
                close_fds=True,
            )
            timed_out = False
            try:
                try:
                    proc.stdin.write((token + "\n").encode())
                    proc.stdin.close()
                except (BrokenPipeError, OSError):
                    pass
                proc.wait(timeout=timeout_s)
            except subprocess.TimeoutExpired:
                timed_out = True
            finally:
                _kill_group(proc.pid)
                proc.wait()
        if timed_out:
            return False, TIMED_OUT
        rc = proc.returncode
        stdout_lines = _tail(out_path).rstrip("\n").split("\n")
        if rc == 0 and stdout_lines[-1] == token:
            return True, PASSED
        stderr = _tail(err_path)

    marked = [line for line in stderr.splitlines() if line.startswith(_FAIL_MARK)]
    if marked:
        return False, "failed: " + marked[-1][len(_FAIL_MARK):][:_REASON_CHARS]
    if rc < 0:
        name = _signal_name(-rc)
        if name == "SIGXCPU":  # the CPU-time limit
            return False, TIMED_OUT
        if name == "SIGXFSZ":
            return False, "failed: wrote too much output (file size limit)"
        return False, f"failed: killed by {name}"
    if rc == 0:
        return False, "failed: exited before the tests finished (exit status 0)"
    last = next((line.strip() for line in reversed(stderr.splitlines()) if line.strip()), "")
    detail = f": {last[:120]}" if last else ""
    return False, f"failed: exit status {rc}{detail}"


def run_many(
    jobs: Iterable[tuple[str, str, str]] | Sequence[tuple[str, str, str]],
    timeout_s: float = 5.0,
    memory_mb: int = 1024,
    workers: int | None = None,
) -> list[tuple[bool, str]]:
    """:func:`check_program` for each ``(program, test, entry_point)``, a few at a time.

    Runs up to ``workers`` children at once (default: min(4, CPU count)) from a small
    thread pool; returns the results in the order of ``jobs``.
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

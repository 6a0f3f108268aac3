"""The two processes of one HumanEval check (standard library only; run as ``python -I this_file MODE ...``).

``harness`` (trusted: our code and the dataset's test) runs the test code itself. It starts the ``candidate``
process, which runs the model's program and nothing else, and calls the program's functions over a pipe:
arguments go there and return values come back as plain data (numbers, strings, bytes, lists, tuples,
dicts, sets, None), decoded here without running any code of the candidate. So the candidate never sees the
test, cannot make a check pass except by returning right values (an object whose ``__eq__`` always says
True does not cross the pipe), and the result is the harness's exit status and the one JSON line it writes
to its stdout, which the candidate cannot reach (it is not among its files, and the harness is not
dumpable, so /proc/<pid>/fd and ptrace are closed to it).

The harness is a child subreaper: every process the candidate starts stays its descendant, ``setsid()``
included, and is killed when the check ends or its time is up. Where it can create one (as root), the
harness puts the candidate into a cgroup of its own whose pids controller caps its processes. The candidate
process sets its limits before the program runs: address space, CPU time, file size, no core dumps and,
where it takes effect (not as root), the number of processes (RLIMIT_NPROC); it reports what it applied
before any of the program runs.
"""

from __future__ import annotations

import builtins
import json
import numbers
import operator
import os
import random
import signal
import subprocess
import sys
import symtable
import time
import traceback
from pathlib import Path

MAX_MESSAGE = 64 << 20  # bytes of one answer of the candidate
MAX_DEPTH = 200  # nesting of a value
PR_SET_PDEATHSIG, PR_SET_DUMPABLE, PR_SET_CHILD_SUBREAPER = 1, 4, 36
REASON_CHARS = 160


# ------------------------------------------------------------------------------------------- values


def encode(value, depth: int = 0):
    """A JSON-able form of plain data (subclasses become their base type: no method of theirs survives)."""
    if depth > MAX_DEPTH:
        raise TypeError("the value is nested too deeply")
    if value is None or type(value) is bool:
        return value
    if isinstance(value, str):
        return str.__str__(value)
    if isinstance(value, int):
        return int.__index__(value)
    if isinstance(value, float):
        return float.__float__(value) if type(value) is not float else value
    if isinstance(value, complex):
        return {"c": [complex.__complex__(value).real, complex.__complex__(value).imag]}
    if isinstance(value, (bytes, bytearray)):
        return {"b": bytes(value).hex()}
    if isinstance(value, list):
        return [encode(v, depth + 1) for v in list.__iter__(value)]
    if isinstance(value, tuple):
        return {"t": [encode(v, depth + 1) for v in tuple.__iter__(value)]}
    if isinstance(value, dict):
        return {"d": [[encode(k, depth + 1), encode(v, depth + 1)] for k, v in dict.items(value)]}
    if isinstance(value, (set, frozenset)):
        return {"f" if isinstance(value, frozenset) else "s": [encode(v, depth + 1) for v in value]}
    if hasattr(type(value), "__index__"):  # e.g. numpy integers
        return operator.index(value)
    if isinstance(value, numbers.Real):  # e.g. numpy floats
        return float(value)
    raise TypeError(f"a {type(value).__name__} object is not plain data")


def decode(data, depth: int = 0):
    """The value ``encode`` wrote; anything else raises ValueError."""
    if depth > MAX_DEPTH:
        raise ValueError("nested too deeply")
    if data is None or type(data) in (bool, int, float, str):
        return data
    if type(data) is list:
        return [decode(v, depth + 1) for v in data]
    if type(data) is dict and len(data) == 1:
        (tag, body), = data.items()
        if tag == "b" and type(body) is str:
            return bytes.fromhex(body)
        if tag == "c" and type(body) is list and len(body) == 2 and all(type(x) in (int, float) for x in body):
            return complex(*body)
        if type(body) is list:
            items = [decode(v, depth + 1) for v in body]
            if tag == "t":
                return tuple(items)
            if tag in ("s", "f"):
                return (set if tag == "s" else frozenset)(items)
            if tag == "d" and all(type(p) is list and len(p) == 2 for p in items):
                return dict((k, v) for k, v in items)
    raise ValueError("not a value")


def send(fd: int, message: dict) -> None:
    data = (json.dumps(message) + "\n").encode()
    while data:
        data = data[os.write(fd, data):]


class Channel:
    """Newline-framed JSON messages read from a pipe, at most MAX_MESSAGE bytes each."""

    def __init__(self, fd: int) -> None:
        self.fd, self.buffer = fd, b""

    def read(self) -> dict | None:
        while b"\n" not in self.buffer:
            if len(self.buffer) > MAX_MESSAGE:
                raise ValueError("message too large")
            chunk = os.read(self.fd, 1 << 16)
            if not chunk:
                return None
            self.buffer += chunk
        line, self.buffer = self.buffer.split(b"\n", 1)
        message = json.loads(line)
        if type(message) is not dict:
            raise ValueError("not a message")
        return message


def prctl(option: int, value: int) -> bool:
    """Linux prctl(2) through libc; False where it is not available."""
    try:
        import ctypes

        return ctypes.CDLL(None, use_errno=True).prctl(option, value, 0, 0, 0) == 0
    except (OSError, AttributeError):
        return False


# -------------------------------------------------------------------------------------- candidate


def candidate_main(argv: list[str]) -> None:
    """argv: program path, request fd, answer fd, memory bytes, CPU seconds, file bytes, process limit
    (0: none). Limits first, then a hello naming them, then the program, then answers."""
    import resource

    path, requests, answers = argv[0], int(argv[1]), int(argv[2])
    memory, cpu, fsize, nproc = map(int, argv[3:7])
    with open(path, encoding="utf-8") as f:
        source = f.read()
    applied = []
    for name, soft, hard, what in (("RLIMIT_AS", memory, memory, "address space limit"),
                                   ("RLIMIT_CPU", cpu, cpu + 1, "CPU time limit"),
                                   ("RLIMIT_FSIZE", fsize, fsize, "file size limit"),
                                   ("RLIMIT_CORE", 0, 0, "no core dumps")):
        if set_limit(resource, name, soft, hard):
            applied.append(what)
    # Root ignores RLIMIT_NPROC, except as the root of a user namespace (which counts its own processes).
    effective = os.getuid() != 0 or os.environ.get("FSD_SANDBOX_USERNS") == "1"
    if nproc and effective and set_limit(resource, "RLIMIT_NPROC", nproc, nproc):
        applied.append(f"RLIMIT_NPROC {nproc}")
    prctl(PR_SET_PDEATHSIG, signal.SIGKILL)
    send(answers, {"hello": applied})
    namespace = {"__name__": "__candidate__", "__file__": path, "__builtins__": builtins}
    try:
        exec(compile(source, path, "exec"), namespace)
    except BaseException as exc:  # noqa: BLE001 - whatever the program raises is its failure
        send(answers, {"raised": describe(exc, path, source)})
        os._exit(1)
    send(answers, {"loaded": True})
    serve(namespace, Channel(requests), answers, path, source)


def set_limit(resource, name: str, soft: int, hard: int) -> bool:
    which = getattr(resource, name, None)
    if which is None:
        return False
    try:
        _, current = resource.getrlimit(which)
        if current != resource.RLIM_INFINITY:
            soft, hard = min(soft, current), min(hard, current)
        resource.setrlimit(which, (soft, hard))
        return True
    except (ValueError, OSError):
        return False


def serve(namespace: dict, channel: Channel, answers: int, path: str, source: str) -> None:
    """Answer the harness: "get" a global (callable, value or missing), "call" a global function."""
    while True:
        request = channel.read()
        if request is None:
            os._exit(0)
        name = request.get("name")
        try:
            if request.get("op") == "get":
                value = namespace.get(name, builtins)  # builtins: a sentinel no program binds to a name
                if value is builtins:
                    send(answers, {"missing": True})
                elif callable(value):
                    send(answers, {"callable": True})
                else:
                    try:
                        send(answers, {"value": encode(value)})
                    except (TypeError, ValueError, RecursionError):
                        send(answers, {"opaque": type(value).__name__})
                continue
            args = [decode(a) for a in request["args"]]
            result = namespace[name](*args)
            send(answers, {"value": encode(result)})
        except BaseException as exc:  # noqa: BLE001 - the candidate's failure, reported to the harness
            send(answers, {"raised": describe(exc, path, source)})


def describe(exc: BaseException, path: str, source: str) -> list:
    """[type name, message, where] of an exception of the program (where: "line N: code" in the program)."""
    text = exc.msg if isinstance(exc, SyntaxError) and exc.msg else str(exc)
    where = ""
    lines = source.splitlines()
    if isinstance(exc, SyntaxError) and exc.lineno:
        where = f"line {exc.lineno}"
    else:
        frames = [fr for fr in traceback.extract_tb(exc.__traceback__) if fr.filename == path]
        if frames and frames[-1].lineno and frames[-1].lineno <= len(lines):
            where = f"line {frames[-1].lineno}: {lines[frames[-1].lineno - 1].strip()[:80]}"
    return [type(exc).__name__, " ".join(text.split())[:120], where]


# ---------------------------------------------------------------------------------------- harness


class Deadline(BaseException):
    """The check's wall-clock time is up (raised by the interval timer, whatever the harness is doing)."""


class CandidateFailed(Exception):
    """The candidate process raised, died, or answered something that is not a value."""

    def __init__(self, status: str) -> None:
        super().__init__(status)
        self.status = status


class Remote:
    """A function of the candidate's program, called over the pipe: arguments and result cross as data."""

    def __init__(self, link: "Link", name: str) -> None:
        self.link, self.__name__ = link, name

    def __call__(self, *args, **kwargs):
        if kwargs:
            raise TypeError("keyword arguments are not passed to the candidate")
        return self.link.ask({"op": "call", "name": self.__name__, "args": [encode(a) for a in args]})


class Link:
    """The harness's end of the pipes to the candidate process."""

    def __init__(self, proc: subprocess.Popen, requests: int, answers: int) -> None:
        self.proc, self.requests, self.channel = proc, requests, Channel(answers)

    def receive(self) -> dict:
        try:
            message = self.channel.read()
        except (ValueError, RecursionError):
            raise CandidateFailed("failed: the candidate sent something that is not a value") from None
        if message is None:
            raise CandidateFailed(exit_status(self.proc))
        if "raised" in message:
            kind, text, where = (list(message["raised"]) + ["", "", ""])[:3]
            raise CandidateFailed("failed: " + reason(str(kind), str(text), str(where)))
        return message

    def ask(self, request: dict):
        try:
            send(self.requests, request)
        except OSError:
            raise CandidateFailed(exit_status(self.proc)) from None
        message = self.receive()
        if "value" not in message:
            raise CandidateFailed("failed: the candidate sent something that is not a value")
        try:
            return decode(message["value"])
        except (ValueError, TypeError, RecursionError):
            raise CandidateFailed("failed: the candidate returned something that is not plain data") from None

    def bind(self, name: str, namespace: dict) -> None:
        """Make the program's global ``name`` visible to the test: a Remote for a function, else its value."""
        try:
            send(self.requests, {"op": "get", "name": name})
        except OSError:
            raise CandidateFailed(exit_status(self.proc)) from None
        message = self.receive()
        if message.get("callable") is True:
            namespace[name] = Remote(self, name)
        elif "value" in message:
            try:
                namespace[name] = decode(message["value"])
            except (ValueError, TypeError, RecursionError):
                raise CandidateFailed("failed: the candidate sent something that is not a value") from None


def exit_status(proc: subprocess.Popen) -> str:
    """Why the candidate process ended before the tests finished."""
    try:
        rc = proc.wait(timeout=1.0)
    except subprocess.TimeoutExpired:
        return "failed: the candidate closed its pipe before the tests finished"
    if rc < 0:
        name = signal_name(-rc)
        if name == "SIGXCPU":
            return "timed out"
        if name == "SIGXFSZ":
            return "failed: wrote too much output (file size limit)"
        return f"failed: killed by {name}"
    return f"failed: exited before the tests finished (exit status {rc})"


def signal_name(number: int) -> str:
    try:
        return signal.Signals(number).name
    except ValueError:
        return f"signal {number}"


def reason(kind: str, text: str, where: str) -> str:
    out = kind + (f": {text}" if text else "") + (f" ({where})" if where else "")
    return out[:REASON_CHARS]


def program_globals(test: str) -> set[str]:
    """Global names the test reads but does not define or import (the program's functions it uses)."""
    top = symtable.symtable(test, "test", "exec")
    defined = {s.get_name() for s in top.get_symbols() if s.is_assigned() or s.is_imported() or s.is_namespace()}
    used, tables = set(), [top]
    while tables:
        table = tables.pop()
        tables.extend(table.get_children())
        for sym in table.get_symbols():
            if sym.is_referenced() and (table is top or sym.is_global()):
                used.add(sym.get_name())
    return used - defined - set(dir(builtins))


def descendants(root: int) -> list[tuple[int, str]]:
    """(pid, state) of every process under ``root``, from /proc (none where there is no /proc: the process
    group kill is all there is)."""
    children: dict[int, list[tuple[int, str]]] = {}
    for entry in os.listdir("/proc") if os.path.isdir("/proc") else ():
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat") as f:
                fields = f.read().rsplit(")", 1)[1].split()
        except (OSError, IndexError):
            continue
        children.setdefault(int(fields[1]), []).append((int(entry), fields[0]))
    found, todo = [], [root]
    while todo:
        for child in children.get(todo.pop(), []):
            found.append(child)
            todo.append(child[0])
    return found


def kill_descendants(seconds: float = 5.0) -> bool:
    """SIGKILL every process under this one until none is left (reaping what the subreaper inherits);
    True when none is left."""
    end = time.monotonic() + seconds
    while time.monotonic() < end:
        alive = [pid for pid, state in descendants(os.getpid()) if state not in ("Z", "X")]
        for pid in alive:
            try:
                os.kill(pid, signal.SIGKILL)
            except OSError:
                pass
        reap()
        if not alive:
            return True
        time.sleep(0.005)
    return False


def reap() -> None:
    while True:
        try:
            pid, _ = os.waitpid(-1, os.WNOHANG)
        except ChildProcessError:
            return
        if pid == 0:
            return


def pids_cgroup(limit: int) -> Path | None:
    """A new cgroup whose pids controller allows ``limit`` processes, under this process's own cgroup (v1
    pids hierarchy, or v2 where pids is delegated); None where none can be made (not root, no controller)."""
    bases = []
    try:
        with open("/proc/self/cgroup") as f:
            lines = [line.rstrip("\n").split(":", 2) for line in f]
    except OSError:
        return None
    for _, controllers, path in (fields for fields in lines if len(fields) == 3):
        if "pids" in controllers.split(","):
            bases.append(Path("/sys/fs/cgroup/pids") / path.lstrip("/"))
        elif controllers == "":
            v2 = Path("/sys/fs/cgroup") / path.lstrip("/")
            try:
                if "pids" in (v2 / "cgroup.subtree_control").read_text().split():
                    bases.append(v2)
            except OSError:
                pass
    for base in bases:
        group = base / f"fsd_humaneval_{os.getpid()}_{random.randrange(1 << 30)}"
        try:
            group.mkdir()
        except OSError:
            continue
        try:
            (group / "pids.max").write_text(str(limit))
            return group
        except OSError:
            remove_cgroup(group)
    return None


def remove_cgroup(group: Path | None) -> None:
    for _ in range(100):
        try:
            if group is not None:
                group.rmdir()
            return
        except FileNotFoundError:
            return
        except OSError:
            time.sleep(0.01)  # the last processes are still leaving


def harness_main(argv: list[str]) -> int:
    """argv: a JSON object {program, test, entry_point, timeout_s, memory, cpu, fsize, nproc, wrap,
    wrap_protections, userns, work, out, err}. Prints one JSON line {"passed", "status", "protections"};
    exit status 0 iff passed."""
    job = json.loads(argv[0])
    protections = []
    group = pids_cgroup(job["cgroup_pids"]) if job["cgroup_pids"] else None
    if group is not None:
        protections.append(f"cgroup of at most {job['cgroup_pids']} processes")
    if prctl(PR_SET_DUMPABLE, 0):
        protections.append("harness not dumpable")
    if prctl(PR_SET_CHILD_SUBREAPER, 1):
        protections.append("subreaper kill of every descendant")
    else:
        protections.append("process group kill")

    def expire(signum, frame):
        raise Deadline

    signal.signal(signal.SIGALRM, expire)
    signal.setitimer(signal.ITIMER_REAL, job["timeout_s"])
    passed, status, proc = False, "failed: the harness did not finish", None
    try:
        proc, link = start_candidate(job, group)
        hello = link.receive()
        protections += list(hello.get("hello", []))
        protections += job["wrap_protections"]
        if "loaded" not in link.receive():
            raise CandidateFailed("failed: the candidate sent something that is not a value")
        with open(job["test"], encoding="utf-8") as f:
            test = f.read()
        namespace = {"__name__": "__test__", "__builtins__": builtins}
        for name in sorted(program_globals(test) | {job["entry_point"]}):
            link.bind(name, namespace)
        if job["entry_point"] not in namespace:
            raise CandidateFailed(f"failed: NameError: name {job['entry_point']!r} is not defined")
        sys.stdout = sys.stderr  # what the test prints must not reach the result line
        exec(compile(test, job["test"], "exec"), namespace)
        namespace["check"](namespace[job["entry_point"]])
        passed, status = True, "passed"
    except Deadline:
        status = "timed out"
    except CandidateFailed as e:
        status = e.status
    except Exception as exc:  # noqa: BLE001 - the test failed (an assertion, or an error in its own code)
        kind, text, where = describe(exc, job["test"], open(job["test"], encoding="utf-8").read())
        status = "failed: " + reason(kind, text, where.replace("line", "test line", 1))
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
    if proc is not None and proc.poll() is None:
        try:
            proc.kill()
        except OSError:
            pass
    cleaned = kill_descendants()
    remove_cgroup(group)
    if not cleaned:
        status = status if not passed else "failed: processes of the candidate could not be stopped"
        passed = False
    sys.stdout = sys.__stdout__
    print(json.dumps({"passed": passed, "status": status, "protections": protections}), flush=True)
    return 0 if passed else 1


def start_candidate(job: dict, group: Path | None) -> tuple[subprocess.Popen, Link]:
    requests_r, requests_w = os.pipe()
    answers_r, answers_w = os.pipe()
    env = {"PATH": os.environ.get("PATH", "/usr/bin:/bin"), "LANG": "C.UTF-8", "HOME": job["work"],
           "TMPDIR": job["work"], "FSD_SANDBOX_USERNS": "1" if job["userns"] else "0"}
    command = [*job["wrap"], sys.executable, "-I", os.path.abspath(__file__), "candidate", job["program"],
               str(requests_r), str(answers_w), str(job["memory"]), str(job["cpu"]), str(job["fsize"]),
               str(job["nproc"])]

    def join_group() -> None:  # in the child, before it runs anything: all it starts stays in the group
        if group is not None:
            (group / "cgroup.procs").write_text(str(os.getpid()))

    with open(job["out"], "wb") as out, open(job["err"], "wb") as err:
        proc = subprocess.Popen(command, stdin=subprocess.DEVNULL, stdout=out, stderr=err, cwd=job["work"], env=env,
                                pass_fds=(requests_r, answers_w), start_new_session=True, preexec_fn=join_group)
    os.close(requests_r)
    os.close(answers_w)
    return proc, Link(proc, requests_w, answers_r)


if __name__ == "__main__":
    if sys.argv[1] == "candidate":
        candidate_main(sys.argv[2:])
    else:
        sys.exit(harness_main(sys.argv[2:]))

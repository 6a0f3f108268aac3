"""Serving benchmark: ``fsd-eagle serve`` with speculation, the same server with ``speculative: false``,
and optionally ``transformers serve --continuous-batching`` (``--hf``), also with ``--compile``
(``--hf-compile``), on one machine and model, under the same load.

    python -m eval serve --concurrency 1,8,32,64 --rate 8 --max-tokens 256 --out eval/results/FILE.json

Load: chat requests built from MT-bench's and Spec-Bench's first turns (MT-bench first, then Spec-Bench's
other subtasks, alternating), greedy, streamed (``stream: true``). Closed loop: C clients, each sending its
next request as soon as the last one ended, ``--requests`` requests per level (at least 2 C); open loop:
requests arriving as a Poisson process of ``--rate`` per second. Per level: output tokens per second (the
completion tokens of every request over the level's wall time), requests per second, time to first token
(TTFT: request sent to its first content chunk) and time per output token after the first (TPOT, the mean
inter-token latency of a request), each as p50 and p99 over the level's requests, and the mean tau that
our server reports in ``usage``. The file is rewritten after every level (a run cut short keeps what it
measured) with device, versions, date, commit and command.

The client is the standard library's ``http.client`` on threads, so the benchmark needs nothing that the
servers do not; a level's first requests warm its batch size (graphs, compiled rounds) before it is timed.
"""

from __future__ import annotations

import argparse
import datetime
import http.client
import json
import os
import random
import shlex
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from .runinfo import git_commit, write_json_atomic
from .tasks import load_mt_bench, load_spec_bench

TIMEOUT_S = 600.0  # the longest one request may take
HF_COMMAND = "{python} -m transformers.cli.transformers serve --continuous-batching --host 127.0.0.1 --port {port}"


@dataclass
class Timing:
    """One request as the client saw it (seconds from the level's start)."""

    sent: float
    first: float | None = None
    done: float | None = None
    chunks: int = 0  # content chunks received
    completion_tokens: int = 0  # from usage; else the content chunks
    tau: float | None = None
    mode: str | None = None  # how our server's rounds ran for it: "compiled", "graph" or "eager"
    error: str | None = None

    @property
    def ttft(self) -> float | None:
        return None if self.first is None else self.first - self.sent

    @property
    def tpot(self) -> float | None:
        if self.first is None or self.done is None or self.completion_tokens < 2:
            return None
        return (self.done - self.first) / (self.completion_tokens - 1)


@dataclass
class Server:
    """A server process on 127.0.0.1:``port``, started by ``command``; ``model`` is what requests name."""

    name: str
    command: list[str]
    port: int
    model: str | None
    health: str = "/health"
    env: dict = field(default_factory=dict)  # added to this process's environment
    proc: subprocess.Popen | None = None
    healthy_s: float | None = None  # from start to the first healthy answer of the health route
    started_s: float | None = None  # from start to the first answered request

    def start(self, log: Path, wait_s: float) -> None:
        t0 = time.perf_counter()
        self.proc = subprocess.Popen(self.command, stdout=open(log, "ab"), stderr=subprocess.STDOUT,
                                     start_new_session=True, env={**os.environ, **self.env})
        deadline = t0 + wait_s
        while True:
            if self.proc.poll() is not None:
                raise RuntimeError(f"{self.name} exited with {self.proc.returncode} before answering (see {log})")
            if time.perf_counter() > deadline:
                raise RuntimeError(f"{self.name} did not answer within {wait_s:.0f} s (see {log})")
            if self._answers():
                break
            time.sleep(0.2)
        self.healthy_s = time.perf_counter() - t0
        first = one_request(self.port, chat_body(self.model, "Say hello.", 8, stream=False), stream=False)
        if first.error:
            raise RuntimeError(f"{self.name}: the first request failed: {first.error}")
        self.started_s = time.perf_counter() - t0

    def _answers(self) -> bool:
        try:
            conn = http.client.HTTPConnection("127.0.0.1", self.port, timeout=2)
            conn.request("GET", self.health)
            return conn.getresponse().status == 200
        except OSError:
            return False

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGTERM)
            try:
                self.proc.wait(60)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait()


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def chat_body(model: str | None, text: str, max_tokens: int, stream: bool = True, **extra) -> dict:
    body = {"messages": [{"role": "user", "content": text}], "max_tokens": max_tokens, "temperature": 0,
            "stream": stream, **extra}
    if model is not None:
        body["model"] = model
    if stream:
        body["stream_options"] = {"include_usage": True}
    return body


def one_request(port: int, body: dict, stream: bool = True, origin: float = 0.0) -> Timing:
    """Send one chat completion and time it (``origin``: the level's start on perf_counter)."""
    t = Timing(sent=time.perf_counter() - origin)
    try:
        conn = http.client.HTTPConnection("127.0.0.1", port, timeout=TIMEOUT_S)
        conn.request("POST", "/v1/chat/completions", json.dumps(body), {"Content-Type": "application/json"})
        resp = conn.getresponse()
        if resp.status != 200:
            t.error = f"HTTP {resp.status}: {resp.read()[:200]!r}"
            return t
        if not stream:
            usage = json.loads(resp.read()).get("usage") or {}
            t.first = t.done = time.perf_counter() - origin
            t.completion_tokens = usage.get("completion_tokens", 0)
            t.mode = (usage.get("speculation") or {}).get("mode")
            return t
        usage = None
        while True:
            line = resp.readline()
            if not line:
                break
            line = line.strip()
            if not line.startswith(b"data: "):
                continue
            data = line[len(b"data: "):]
            if data == b"[DONE]":
                break
            event = json.loads(data)
            if "error" in event:
                t.error = str(event["error"])[:200]
                break
            for choice in event.get("choices") or []:
                if (choice.get("delta") or {}).get("content"):
                    t.chunks += 1
                    if t.first is None:
                        t.first = time.perf_counter() - origin
            usage = event.get("usage") or usage
        t.done = time.perf_counter() - origin
        t.completion_tokens = (usage or {}).get("completion_tokens") or t.chunks
        t.tau = ((usage or {}).get("speculation") or {}).get("tau")
        t.mode = ((usage or {}).get("speculation") or {}).get("mode")
        conn.close()
    except (OSError, ValueError, http.client.HTTPException) as e:
        t.error = f"{type(e).__name__}: {e}"[:200]
    return t


def closed_loop(port: int, bodies: list[dict], concurrency: int) -> tuple[list[Timing], float]:
    """``concurrency`` clients sending ``bodies`` in turn until all are sent; (their timings in the order of
    ``bodies``, wall seconds)."""
    origin, lock = time.perf_counter(), threading.Lock()
    timings: list[Timing | None] = [None] * len(bodies)
    queue = list(reversed(range(len(bodies))))

    def client() -> None:
        while True:
            with lock:
                if not queue:
                    return
                i = queue.pop()
            timings[i] = one_request(port, bodies[i], origin=origin)

    threads = [threading.Thread(target=client) for _ in range(concurrency)]
    [t.start() for t in threads]
    [t.join() for t in threads]
    return timings, time.perf_counter() - origin  # type: ignore[return-value]


def open_loop(port: int, bodies: list[dict], rate: float, seed: int = 0) -> tuple[list[Timing], float]:
    """``bodies`` sent at the arrival times of a Poisson process of ``rate`` per second."""
    rng, origin, lock, timings, threads = random.Random(seed), time.perf_counter(), threading.Lock(), [], []
    at = 0.0

    def send(body: dict) -> None:
        t = one_request(port, body, origin=origin)
        with lock:
            timings.append(t)

    for body in bodies:
        at += rng.expovariate(rate)
        time.sleep(max(0.0, origin + at - time.perf_counter()))
        threads.append(threading.Thread(target=send, args=(body,)))
        threads[-1].start()
    [t.join() for t in threads]
    return timings, time.perf_counter() - origin


def percentile(values: list[float], q: float) -> float | None:
    if not values:
        return None
    values = sorted(values)
    return values[min(len(values) - 1, max(0, round(q / 100 * (len(values) - 1))))]


def summarize(timings: list[Timing], wall: float) -> dict:
    ok = [t for t in timings if t.error is None]
    tokens = sum(t.completion_tokens for t in ok)
    ttft = [t.ttft for t in ok if t.ttft is not None]
    tpot = [t.tpot for t in ok if t.tpot is not None]
    taus = [t.tau for t in ok if t.tau is not None]
    ms = lambda v: None if v is None else round(1000 * v, 2)  # noqa: E731
    return {"requests": len(timings), "errors": len(timings) - len(ok),
            "first_error": next((t.error for t in timings if t.error), None), "completion_tokens": tokens,
            "wall_s": round(wall, 3), "output_tokens_per_s": round(tokens / wall, 1) if wall else None,
            "requests_per_s": round(len(ok) / wall, 3) if wall else None,
            "ttft_ms_p50": ms(percentile(ttft, 50)), "ttft_ms_p99": ms(percentile(ttft, 99)),
            "tpot_ms_p50": ms(percentile(tpot, 50)), "tpot_ms_p99": ms(percentile(tpot, 99)),
            "tau_mean": round(sum(taus) / len(taus), 3) if taus else None,
            "modes": modes_of(ok)}


def modes_of(timings: list[Timing]) -> dict:
    """How many of ``timings`` our server decoded in each mode ({} for servers that do not say)."""
    counts: dict = {}
    for t in timings:
        if t.mode is not None:
            counts[t.mode] = counts.get(t.mode, 0) + 1
    return counts


def warm(port: int, bodies: list[dict], level: int, until_compiled: bool, deadline: float) -> float:
    """Run ``bodies`` (short requests) on ``level`` clients: the level's batch size gets its sessions. With
    ``until_compiled``, again until every answer says its rounds ran compiled (our server makes compiled
    rounds in the background and moves to them once ready) or ``deadline`` (perf_counter) passes. Returns
    the seconds it took."""
    start = time.perf_counter()
    while True:
        timings, _ = closed_loop(port, bodies, level)
        modes = modes_of([t for t in timings if t.error is None])
        if not until_compiled or "graph" not in modes or time.perf_counter() > deadline:
            return time.perf_counter() - start


def prompts(n: int) -> list[str]:
    """MT-bench's first turns, then Spec-Bench's other questions' first turns, ``n`` in all (repeated)."""
    texts = [q.turns[0] for q in load_mt_bench()]
    texts += [q.turns[0] for q in load_spec_bench() if q.subtask != "mt_bench"]
    return [texts[i % len(texts)] for i in range(n)]


@dataclass
class Variant:
    """One column of the table: a server and what its requests add (ours: ``speculative``)."""

    name: str
    server: str
    extra: dict = field(default_factory=dict)


def servers_and_variants(ours: list[str], args: argparse.Namespace) -> tuple[dict, list[Variant]]:
    """The servers to start ({name: (command, model that requests name, health route)}) and the table's
    columns: ours with and without speculation; with ``--hf``, ``transformers serve`` (``--hf-command``); with
    ``--hf-compile`` also that command with ``--compile`` (torch.compile in transformers serve)."""
    servers = {"fsd-eagle": (ours, None, "/health")}
    variants = [Variant("speculative", "fsd-eagle"), Variant("plain", "fsd-eagle", {"speculative": False})]
    hf = [("transformers", "transformers serve", [])] if args.hf else []
    if args.hf_compile:
        hf.append(("transformers-compile", "transformers serve --compile", ["--compile"]))
    for name, column, extra in hf:
        servers[name] = (shlex.split(args.hf_command) + extra, args.hf_model, args.hf_health)
        variants.append(Variant(column, name))
    return servers, variants


def run(args: argparse.Namespace) -> dict:
    out = Path(args.out)
    logs = out.with_suffix(".logs")
    logs.mkdir(parents=True, exist_ok=True)
    levels = [("closed", c) for c in args.concurrency] + [("poisson", r) for r in args.rate]
    most = max(args.concurrency + args.startup + [args.max_batch or 0, 1])
    ours = [sys.executable, "-m", "fsd_eagle.cli", "serve", "--port", "{port}", "--max-batch", str(args.max_batch or most),
            "--max-queue", str(max(256, 4 * most)), "--max-model-len", str(args.max_model_len), "--quiet",
            *args.serve_args]
    servers, variants = servers_and_variants(ours, args)
    compiling = "--no-compile" not in args.serve_args  # on a GPU our server compiles rounds in the background
    cache = Path(args.compile_cache) if args.compile_cache else logs / "compile-cache"
    cache_env = {"TORCHINDUCTOR_CACHE_DIR": str(cache / "inductor"), "TRITON_CACHE_DIR": str(cache / "triton")}
    header = {"benchmark": "serving", "date": datetime.date.today().isoformat(), "code": git_commit(short=True),
              "command": "python -m eval serve " + " ".join(shlex.quote(a) for a in args.argv),
              "device": device_name(), "versions": versions(), "max_tokens": args.max_tokens,
              "prompts": "MT-bench first turns, then Spec-Bench's other subtasks' first turns", "rows": []}
    if args.startup:
        def save(partial: dict) -> None:
            write_json_atomic(out, ratios({**header, "startup": partial}))
        header["startup"] = startup(ours, cache_env, logs, args, save)
    for name, (command, model, health) in servers.items() if levels or args.mixed_fsd else ():
        port = free_port()
        server = Server(name, [a.replace("{port}", str(port)).replace("{python}", sys.executable) for a in command],
                        port, model, health, cache_env if name == "fsd-eagle" else {})
        print(f"starting {name}: {' '.join(server.command)}", file=sys.stderr, flush=True)
        try:
            server.start(logs / f"{name}.log", args.start_timeout)
            header.setdefault("start_s", {})[name] = round(server.started_s, 1)
            for variant in (v for v in variants if v.server == name):
                for kind, level in levels:
                    n = args.hf_requests if name != "fsd-eagle" and args.hf_requests else args.requests
                    count = max(n, 2 * level) if kind == "closed" else n
                    texts = prompts(count + (level if kind == "closed" else 0))
                    bodies = [chat_body(model, t, args.max_tokens, **variant.extra) for t in texts]
                    warm_s = None
                    if kind == "closed":  # warm this batch size (until its rounds run compiled), then time the level
                        warm_s = warm(port, [dict(b, max_tokens=16) for b in bodies[:level]], level,
                                      compiling and name == "fsd-eagle", time.perf_counter() + args.start_timeout)
                        timings, wall = closed_loop(port, bodies[level:], level)
                    else:
                        timings, wall = open_loop(port, bodies[:count], level)
                    row = {"server": variant.name, "load": kind, ("concurrency" if kind == "closed" else "rate"): level,
                           **summarize(timings, wall), "warm_s": None if warm_s is None else round(warm_s, 1)}
                    header["rows"].append(row)
                    print(json.dumps(row), file=sys.stderr, flush=True)
                    write_json_atomic(out, ratios(header))
                if variant.name == "speculative" and args.mixed_fsd:
                    header["mixed_fsd"] = mixed_fsd(port, args)
                    print(json.dumps(header["mixed_fsd"]), file=sys.stderr, flush=True)
                    write_json_atomic(out, ratios(header))
        finally:
            server.stop()
    return ratios(header)


def startup(command: list[str], env: dict, logs: Path, args: argparse.Namespace,
            save: Callable[[dict], None]) -> dict:
    """Start our server twice on the same compile cache (``env``), the first time with what the cache holds
    (nothing on a fresh machine), then again after a SIGTERM (a restart), each time timing its health route
    and first answer, then per ``--startup`` level waves of closed-loop requests (``--startup-tokens`` new
    tokens each) until every answer of a wave ran compiled: when that happened (seconds from the start) and
    the output tokens/s of the waves before (graph rounds) and of the last one (compiled). Off a GPU rounds
    run eagerly and the first wave ends the level. ``save`` gets the result so far after each wave and level, so an
    interrupted run keeps what it measured."""
    result = {"cache_held_files_before": sum(1 for p in Path(env["TORCHINDUCTOR_CACHE_DIR"]).rglob("*") if p.is_file())
              if Path(env["TORCHINDUCTOR_CACHE_DIR"]).is_dir() else 0}
    for attempt in ("first", "restart"):
        port = free_port()
        server = Server("fsd-eagle", [a.replace("{port}", str(port)) for a in command], port, None, env=env)
        t0 = time.perf_counter()
        server.start(logs / f"startup-{attempt}.log", args.start_timeout)
        entry = {"health_s": round(server.healthy_s, 1), "first_answer_s": round(server.started_s, 1), "levels": {}}
        result[attempt] = entry
        save(result)
        try:
            for level in args.startup:
                bodies = [chat_body(None, t, args.startup_tokens) for t in prompts(level)]
                before, last, deadline = [], None, t0 + args.start_timeout
                while time.perf_counter() < deadline:
                    timings, wall = closed_loop(port, bodies, level)
                    ok = [t for t in timings if t.error is None]
                    wave = {"at_s": round(time.perf_counter() - t0, 1), "modes": modes_of(ok),
                            "tokens_per_s": round(sum(t.completion_tokens for t in ok) / wall, 1)}
                    if "graph" not in wave["modes"]:  # all compiled (or, off a GPU, eager: nothing to wait for)
                        last = wave
                        break
                    before.append(wave)
                    entry["levels"][str(level)] = {"compiled_at_s": None, "waves_before": len(before), "last_wave": wave}
                    save(result)
                rates = [w["tokens_per_s"] for w in before]
                entry["levels"][str(level)] = {
                    "compiled_at_s": last and last["at_s"], "compiled_tokens_per_s": last and last["tokens_per_s"],
                    "waves_before": len(before), "tokens_per_s_before": round(sum(rates) / len(rates), 1) if rates else None,
                    "first_wave": before[0] if before else last}
                print(json.dumps({"startup": attempt, "level": level, **entry["levels"][str(level)]}), file=sys.stderr,
                      flush=True)
                save(result)
        finally:
            server.stop()
    save(result)
    return result


def mixed_fsd(port: int, args: argparse.Namespace) -> dict:
    """One closed-loop level of ``--mixed-fsd`` clients on our server where every other request asks for FSD
    (``fsd: {threshold: --fsd-threshold}``) and the rest for exact decoding: both groups share the server's
    rounds; each group's output tokens/s (its completion tokens over the level's wall time) and tau."""
    c = args.mixed_fsd
    fsd = {"fsd": {"threshold": args.fsd_threshold, "divergence": "kl"}}
    texts = prompts(max(args.requests, 2 * c) + c)
    bodies = [chat_body(None, t, args.max_tokens, **(fsd if i % 2 else {})) for i, t in enumerate(texts)]
    closed_loop(port, [dict(b, max_tokens=16) for b in bodies[:c]], c)
    timed = bodies[c:]
    got, wall = closed_loop(port, timed, c)
    timings = {"exact": [t for b, t in zip(timed, got) if "fsd" not in b],
               "fsd": [t for b, t in zip(timed, got) if "fsd" in b]}
    return {"concurrency": c, "fsd": fsd["fsd"], "wall_s": round(wall, 3),
            "groups": {name: summarize(ts, wall) for name, ts in timings.items()}}


def ratios(result: dict) -> dict:
    """Add, per level, speculation's output tokens/s over the plain server's and over transformers serve's
    (without and with ``--compile``), and its TPOT p50 over the plain server's."""
    rows = result["rows"]
    key = lambda r: (r["load"], r.get("concurrency", r.get("rate")))  # noqa: E731
    by = {(r["server"], key(r)): r for r in rows}
    table = []
    for r in rows:
        if r["server"] != "speculative":
            continue
        plain = by.get(("plain", key(r)))
        entry = {"load": r["load"], "level": key(r)[1]}
        if plain and plain["output_tokens_per_s"]:
            entry["vs_plain_tokens_per_s"] = round(r["output_tokens_per_s"] / plain["output_tokens_per_s"], 3)
            if plain["tpot_ms_p50"] and r["tpot_ms_p50"]:
                entry["tpot_p50_vs_plain"] = round(r["tpot_ms_p50"] / plain["tpot_ms_p50"], 3)
        for column, ratio in (("transformers serve", "vs_transformers_tokens_per_s"),
                              ("transformers serve --compile", "vs_transformers_compile_tokens_per_s")):
            hf = by.get((column, key(r)))
            if hf and hf["output_tokens_per_s"]:
                entry[ratio] = round(r["output_tokens_per_s"] / hf["output_tokens_per_s"], 3)
        table.append(entry)
    return {**result, "ratios": table}


def device_name() -> str:
    try:
        import torch

        return torch.cuda.get_device_name() if torch.cuda.is_available() else f"cpu ({os.cpu_count()} cores)"
    except ImportError:
        return "unknown"


def versions() -> dict:
    from .runinfo import dist_version

    return {name: dist_version(name) for name in ("torch", "transformers", "fastapi", "uvicorn", "fsd-eagle")}


def parser() -> argparse.ArgumentParser:
    from fsd_eagle.cli import OneLineParser

    p = OneLineParser(prog="python -m eval serve", description=__doc__.split("\n\n")[0])
    ints = lambda s: [int(x) for x in s.split(",") if x]  # noqa: E731
    floats = lambda s: [float(x) for x in s.split(",") if x]  # noqa: E731
    p.add_argument("--concurrency", type=ints, default=[1, 8, 32, 64],
                   help="closed-loop clients per level (\"\": none; with --rate \"\", only --startup)")
    p.add_argument("--rate", type=floats, default=[8.0], help="open-loop Poisson arrival rates (requests/s)")
    p.add_argument("--requests", type=int, default=64, help="timed requests per level (closed: at least 2 C)")
    p.add_argument("--max-tokens", type=int, default=256)
    p.add_argument("--max-batch", type=int, default=None, help="the server's --max-batch (default: the most clients)")
    p.add_argument("--max-model-len", type=int, default=2048)
    p.add_argument("--serve-args", type=shlex.split, default=[],
                   help="more options of fsd-eagle serve, as one string (e.g. \"--compile --device cuda\")")
    p.add_argument("--hf", action="store_true", help="also measure transformers serve --continuous-batching")
    p.add_argument("--hf-compile", action="store_true",
                   help="also measure transformers serve with --compile (the --hf-command plus --compile)")
    p.add_argument("--hf-command", default=HF_COMMAND,
                   help="its command ({port} and {python}, this Python, are filled in; add the model folder to preload "
                        "it, and its options)")
    p.add_argument("--hf-model", default=None, help="the model that requests to it name (a local folder)")
    p.add_argument("--hf-health", default="/health")
    p.add_argument("--hf-requests", type=int, default=None, help="timed requests per level for transformers serve "
                                                                    "(default --requests; it decodes far slower)")
    p.add_argument("--mixed-fsd", type=int, default=0, metavar="C",
                   help="also one level of C clients where every other request asks for FSD (0: none)")
    p.add_argument("--fsd-threshold", type=float, default=1.0, help="the FSD threshold of --mixed-fsd requests")
    p.add_argument("--start-timeout", type=float, default=900.0,
                   help="seconds a server may take to answer, and a level to reach compiled rounds")
    p.add_argument("--compile-cache", default=None,
                   help="our server's compile cache folder (default: <out>.logs/compile-cache)")
    p.add_argument("--startup", type=ints, default=[], metavar="LEVELS",
                   help="first measure start-up and a restart: per level, until its rounds run compiled")
    p.add_argument("--startup-tokens", type=int, default=64, help="new tokens of each start-up request")
    p.add_argument("--out", required=True)
    return p


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    args = parser().parse_args(argv)
    args.argv = argv
    if (args.hf or args.hf_compile) and not args.hf_model:
        print("error: --hf and --hf-compile need --hf-model (the model folder that transformers serve loads)",
              file=sys.stderr)
        return 2
    try:
        result = run(args)
    except (RuntimeError, OSError) as e:  # a server that did not start: what was measured is in --out
        print(f"error: {' '.join(str(e).split())}", file=sys.stderr)
        return 2
    print(json.dumps(result["ratios"], indent=1))
    return 0

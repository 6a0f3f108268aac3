"""Compiled rounds for a server that answers from its start: the slow compilation runs in another process.

A configuration is a rule form and a batch bucket (``Key``): what a session's code depends on. The server
answers on CUDA-graph rounds from the start. The first time a lane of a configuration opens, the engine
asks for it (``Compiler.ask``); a **worker process** (``python -m fsd_eagle.server.compiler``), loaded with
the same model, compiles that configuration's session and runs one short decode on it (``warm``: the
prefill and the round compiled with torch.compile and captured), minutes on a cold compile cache. Its
kernels land in the compile cache folder the server shares with it (``TORCHINDUCTOR_CACHE_DIR``, inherited).
Once it answers, the engine thread makes the same session in the server's process between two rounds,
now from a warm cache (where the worker could save the compiled round and prefill whole, fsd_eagle.precompiled,
they are loaded without tracing; else dynamo traces again and every kernel is a cache hit; graphs are
captured; the running rounds wait meanwhile), and new requests of that configuration decode on it while the graph lane
drains: each request decodes in one mode from its start to its end.

Why another process and not a thread: torch.compile and CUDA graph capture are not safe beside a thread
that decodes. Dynamo and FX keep process-wide state (a FlexAttention call on the decoding thread fails
while the other one traces), inductor's autotuning synchronises the device, and a capture on one thread is
broken by work the other one starts (measured on an H200: "operation not permitted when stream is
capturing", a memory pool "already recording", and compiled rounds that then ran at a few tokens/s).

On a restart none of this is needed for the configurations an earlier server took over: they are recorded
(fsd_eagle.server.records) and the engine makes them from saved functions alone (fsd_eagle.server.engine).

A worker that fails for one configuration leaves it on graph rounds, with one line on stderr; one that
ends leaves every configuration not yet compiled on graph rounds.
"""

from __future__ import annotations

import base64
import io
import json
import os
import subprocess
import sys
import threading
import time
from typing import Callable

import torch

from ..api import PreparedCall, SpeculativeGenerator
from ..attention import PACK_ROWS
from ..decode import DecodeStats, failure
from ..errors import FSDError
from ..schedule import ROUND_END, Request, Scheduler
from ..session import Session

Key = tuple  # (form_of(call), batch bucket)
Ready = Callable[[Key, PreparedCall, int, float], None]  # (key, call, rows, seconds the cache took)
WARM_NEW_TOKENS = 24  # a prefill and a few rounds: every row runs a captured round at least once


def warm(session: Session, call: PreparedCall, context: int) -> None:
    """Decode as the server's lanes do, so that the session compiles and captures what they later replay:
    an open-ended scheduler with the lane's caches (``context`` tokens per row: compiled code is specialised
    to the cache size), in waves that reach each form of prefill a lane meets: a short prompt on every row,
    then on one row (a one-row prefill compiles apart from batched ones), then a prompt longer than
    ``attention.PACK_ROWS`` query rows per key/value head (prefill masks take another form there) on every
    row and on one; all cut from ``call``'s prompt (repeated as needed), under its rule, seed 0."""
    scheduler = Scheduler(session, [], session.batch, open_ended=True, max_len=Scheduler.cache_for(session, context))
    steps = scheduler.run()
    long = min(PACK_ROWS + 1, context - WARM_NEW_TOKENS)
    rows = session.batch
    waves = [(8, rows), (8, 1), (long, rows), (long, 1)] if rows > 1 else [(8, 1), (long, 1)]
    for length, count in waves:
        prompt = call.prompt_ids.to(session.target.device).repeat(-(-length // len(call.prompt_ids)))[:length]
        if not scheduler.fits(len(prompt), WARM_NEW_TOKENS):
            continue
        for _ in range(count):
            scheduler.submit(Request(prompt, WARM_NEW_TOKENS, call.rule, 0, DecodeStats()))
        for item in steps:
            if item is ROUND_END and scheduler.idle:
                break


def make_compiled(gen: SpeculativeGenerator, call: PreparedCall, rows: int, context: int) -> Session:
    """The compiled session of ``call``'s configuration on ``rows`` rows, warmed up for lanes of ``context``
    tokens per row (compiled and captured)."""
    session = gen.session_for(call, rows, compiled=True)
    warm(session, call, context)
    return session


class Compiler:
    """Gets the compile cache of each configuration asked for warm, once per configuration, in the order
    asked, and calls ``ready(key, call, rows, seconds)`` (on a thread of its own) when it is. ``warm_cache(call,
    rows)``: how (default: the worker process, loaded with ``options``, the keyword arguments of
    ``SpeculativeGenerator.load`` plus ``attention``)."""

    def __init__(self, ready: Ready, context: int, options: dict | None = None,
                 warm_cache: Callable[[PreparedCall, int], None] | None = None) -> None:
        if (options is None) == (warm_cache is None):
            raise ValueError("give the worker's load options or a warm_cache function, one of them")
        self.ready, self.context, self.options, self.warm_cache = ready, context, options, warm_cache
        self.asked: set[Key] = set()
        self.pending: dict[int, tuple[Key, PreparedCall, int, float]] = {}  # by job number, sent to the worker
        self.worker: subprocess.Popen | None = None
        self.closing = False
        self._lock = threading.Lock()

    def start(self) -> None:
        """Start the worker now, so that it loads the model before the first configuration is asked for
        (``ask`` starts it otherwise); once per compiler."""
        with self._lock:
            self._start()

    def _start(self) -> None:
        if self.options is None or self.worker is not None:
            return
        command = [sys.executable, "-m", "fsd_eagle.server.compiler", json.dumps(self.options)]
        # A session of its own: a Ctrl-C or a signal to the server's process group is the server's to handle
        # (it ends the worker in ``close``); a server that dies closes the worker's stdin, which ends it.
        self.worker = subprocess.Popen(command, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True,
                                       bufsize=1, env={**os.environ, "PYTHONUNBUFFERED": "1"},
                                       start_new_session=True)
        threading.Thread(target=self._read, name="fsd-eagle-compiler", daemon=True).start()

    def ask(self, key: Key, call: PreparedCall, rows: int) -> None:
        """Get ``key``'s cache warm (``call``'s form on ``rows`` rows), once per key (starting the worker if
        it has not started)."""
        with self._lock:
            if key in self.asked:
                return
            self._start()
            self.asked.add(key)
            job = len(self.asked)
            self.pending[job] = (key, call, rows, time.perf_counter())
        if self.warm_cache is not None:
            threading.Thread(target=self._warm_here, args=(job,), daemon=True).start()
            return
        line = json.dumps({"job": job, "rows": rows, "context": self.context, "call": pack(call)})
        try:
            self.worker.stdin.write(line + "\n")
            self.worker.stdin.flush()
        except (OSError, ValueError):  # the worker is gone (its end was reported by the reader)
            pass

    def close(self) -> None:
        self.closing = True
        if self.worker is not None and self.worker.poll() is None:
            self.worker.terminate()
            try:
                self.worker.wait(10)
            except subprocess.TimeoutExpired:
                self.worker.kill()

    def _warm_here(self, job: int) -> None:
        with self._lock:
            key, call, rows, start = self.pending.pop(job)
        try:
            self.warm_cache(call, rows)
        except Exception as e:
            print(f"fsd-eagle: compiled rounds for {rows} rows not used: {failure(e)}", file=sys.stderr)
            return
        self.ready(key, call, rows, time.perf_counter() - start)

    def _read(self) -> None:
        for line in self.worker.stdout:
            try:
                answer = json.loads(line)
                with self._lock:
                    key, call, rows, start = self.pending.pop(answer["job"])
            except (ValueError, KeyError, TypeError):
                continue  # not an answer (nothing else should be written there)
            if "error" in answer:
                print(f"fsd-eagle: compiled rounds for {rows} rows not used: {answer['error']}", file=sys.stderr)
            else:
                self.ready(key, call, rows, time.perf_counter() - start)
        code = self.worker.wait()
        if not self.closing:
            print(f"fsd-eagle: the compiling process ended (exit {code}); configurations not compiled yet stay on "
                  "graph rounds", file=sys.stderr)


def pack(call: PreparedCall) -> str:
    """``call`` as one line of text for the worker (torch.save, base64); the worker moves its prompt to its
    device (the server's calls hold theirs on the CPU)."""
    buffer = io.BytesIO()
    torch.save(call, buffer)
    return base64.b64encode(buffer.getvalue()).decode()


def unpack(text: str) -> PreparedCall:
    return torch.load(io.BytesIO(base64.b64decode(text)), weights_only=False)


def main(argv: list[str] | None = None) -> int:
    """The worker: load the generator ``argv[0]`` (JSON) describes, then for each job line on stdin make and
    warm that configuration's compiled session, answering ``{"job", "seconds"}`` or ``{"job", "error"}`` on
    stdout. Anything else the libraries print goes to stderr, so stdout carries answers only."""
    options = json.loads((argv or sys.argv[1:])[0])
    answers = os.fdopen(os.dup(1), "w", buffering=1)
    os.dup2(2, 1)
    sys.stdout = sys.stderr
    from transformers.utils import logging as hf_logging

    hf_logging.set_verbosity_error()  # stderr is the server's: no loading bars from this process
    hf_logging.disable_progress_bar()
    attention = options.pop("attention", None)
    try:
        gen = SpeculativeGenerator.load(**options)
        gen.use_attention(attention)
    except FSDError as e:
        print(f"fsd-eagle: the compiling process could not load the model: {e}", file=sys.stderr)
        return 1
    for line in sys.stdin:
        job = json.loads(line)
        start = time.perf_counter()
        try:
            call = unpack(job["call"])
            call.prompt_ids = call.prompt_ids.to(gen.target.device)
            make_compiled(gen, call, job["rows"], job["context"])
            gen.release()  # the server makes its own session: this process only fills the cache
            answer = {"job": job["job"], "seconds": round(time.perf_counter() - start, 3)}
        except Exception as e:
            answer = {"job": job["job"], "error": failure(e)}
        answers.write(json.dumps(answer) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())

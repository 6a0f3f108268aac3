"""The generator behind an async interface: one engine thread decodes every request of the server.

Requests of one rule form (greedy, sampling, fuzzy; speculative or plain) decode as rows of an open-ended
``Scheduler`` (a lane) over the generator's session for that form and batch size
(``SpeculativeGenerator.session_for``): a request joins the running batch at the next round boundary and
leaves it when it ends, and requests that differ only in rule numbers (temperature, top-p, threshold),
seeds or stop strings share rounds. A lane's size is the batch bucket of the demand when it opens (the
requests of its form that arrive together, plus those already running), at most ``max_batch``: one client
decodes on a one-row session with the batch-1 tree, 32 clients on a 32-row session with the tree tuned for
32. When a lane is full and more requests of its form arrive, a larger lane opens beside it and the small
one drains; an idle lane closes. Lanes take rounds in turn, so no form waits for another to drain. Each
request decodes what ``SpeculativeGenerator.generate`` decodes for it alone.

With ``compile`` (GPU servers), lanes open on graph sessions and a ``Compiler`` gets the compile cache of
each configuration met warm in another process (fsd_eagle.server.compiler); once it is, this thread makes
the compiled session between two rounds (from the warm cache: seconds), new requests of that configuration
open a lane on it and the graph lane takes no more requests and drains.

Each configuration taken over is recorded beside the saved compiled functions (fsd_eagle.server.records).
A later server (a restart) makes the recorded ones from saved functions alone before it answers, newest
first, for up to ``PREBUILD_SECONDS``, and the rest when a lane of theirs opens, without the compiling
process (``precompiled.loads_only``: nothing compiles on this thread; a configuration whose functions are
not all saved goes to the compiling process as a new one would).

The event loop talks to the thread through a queue of commands (submit, cancel, stop); the thread answers
each job through its ``emit`` callback (thread-safe: ``loop.call_soon_threadsafe``), with text pieces
(``Piece``), the final result (``Done``) or a one-line failure (``Failed``).
"""

from __future__ import annotations

import asyncio
import contextlib
import queue
import sys
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Iterator

from ..api import GenerationResult, PreparedCall, SpeculativeGenerator, TextOutput
from ..errors import FSDError, out_of_memory_line
from ..precompiled import NotSaved, loads_only
from ..schedule import ROUND_END, Request, Scheduler
from ..session import Session, session_rows
from .compiler import Compiler, make_compiled as compiled_session
from .metrics import Metrics
from .records import Record, record, recorded

#: How long a starting server spends making recorded configurations from saved functions before it answers
#: (a configuration is begun only if the one before it says it will end in time): a restart's first
#: requests then decode on compiled rounds, and ``/health`` still comes well inside a minute.
PREBUILD_SECONDS = 30.0


@dataclass
class Piece:
    text: str


@dataclass
class Done:
    result: GenerationResult


@dataclass
class Failed:
    message: str


Event = Piece | Done | Failed


@dataclass(eq=False)
class Job:
    """One choice of one request: its prepared call, whether it streams text, and where events go."""

    call: PreparedCall
    streaming: bool
    emit: Callable[[Event], None]
    submitted_at: float = field(default_factory=time.perf_counter)
    first_at: float | None = None  # when its first token was decoded
    last_at: float | None = None  # when its last tokens were decoded


@dataclass
class _Lane:
    """The open-ended scheduler of one session (rule form and batch size) and the jobs on it, by request
    index; ``form`` identifies the requests it may take."""

    form: tuple
    session: Session
    scheduler: Scheduler
    steps: Iterator
    jobs: dict[int, tuple[Job, TextOutput]] = field(default_factory=dict)
    failed: bool = False  # a round raised: the lane takes nothing more and closes
    draining: bool = False  # a compiled session of its configuration took over: it takes no more requests

    @property
    def open(self) -> bool:
        return not self.failed and not self.scheduler.idle

    @property
    def taking(self) -> bool:
        """Whether new requests may join it."""
        return not self.failed and not self.draining

    @property
    def free(self) -> int:
        """Rows no request holds or waits for."""
        return self.scheduler.rows - self.scheduler.running - len(self.scheduler.waiting)


def form_of(call: PreparedCall) -> tuple:
    """What requests must share to decode as rows of one lane: plain or speculative, and the rule's form."""
    return call.autoregressive, call.rule.form


def key_of(call: PreparedCall, rows: int) -> tuple:
    """The configuration a session serves: the form of ``call`` on the batch bucket of ``rows``."""
    return form_of(call), session_rows(rows)


class QueueFull(FSDError):
    """More requests wait than the server's ``max_queue``."""


class EngineLoop:
    """Runs ``gen``'s sessions on one thread for the server: ``submit`` jobs from any thread (the event
    loop's), ``cancel`` them, ``close`` at shutdown. ``max_batch`` rows per rule form decode together;
    at most ``max_queue`` jobs wait for a row; caches hold ``context`` tokens per row. ``compile``: move
    each configuration to compiled rounds once its compile cache is warm (only where rounds are captured,
    on a GPU: elsewhere a compiled session is the graph one). How the cache gets warm: a worker process
    loaded with ``compile_options`` (``SpeculativeGenerator.load``'s arguments and ``attention``), or
    ``warm_cache(call, rows)`` on a thread of its own; ``make_compiled(call, rows)``: how this thread then
    makes the configuration's session (default: the generator's compiled one, warmed up). ``records``: the
    folder where configurations taken over are recorded and those recorded by earlier servers are found
    (fsd_eagle.server.records; None: none)."""

    def __init__(self, gen: SpeculativeGenerator, max_batch: int, max_queue: int, context: int,
                 metrics: Metrics, compile: bool = False, compile_options: dict | None = None,
                 warm_cache: Callable[[PreparedCall, int], None] | None = None,
                 make_compiled: Callable[[PreparedCall, int], Session] | None = None,
                 records: Path | None = None) -> None:
        self.gen, self.max_batch, self.max_queue, self.context = gen, max_batch, max_queue, context
        self.metrics = metrics
        self.commands: queue.SimpleQueue = queue.SimpleQueue()
        self.lanes: list[_Lane] = []
        self.compiled: dict[tuple, Session] = {}  # configurations (key_of) whose compiled session took over
        self.make_compiled = make_compiled or (lambda call, rows: compiled_session(gen, call, rows, context))
        captured = gen.cuda_graphs and gen.target.device.type == "cuda"
        wanted = compile and (captured or warm_cache is not None)
        self.compiler = Compiler(self._cache_ready, context, compile_options, warm_cache) if wanted else None
        self.records = records if self.compiler is not None else None
        self.recorded: dict[tuple, Record] = {}  # recorded configurations not made yet (no time before ready)
        self.loading: set[tuple] = set()  # recorded configurations whose making here is queued
        self.waiting = 0  # jobs submitted and not yet started (read by submit's caller for 429)
        self._lock = threading.Lock()
        self.thread = threading.Thread(target=self._run, name="fsd-eagle-engine", daemon=True)
        self.ready = threading.Event()
        self.failed: str | None = None

    # ------------------------------------------------------------------ called from the event loop

    def start(self) -> None:
        self.thread.start()

    def submit(self, jobs: list[Job]) -> None:
        """Queue ``jobs`` (the choices of one request, together): QueueFull when ``max_queue`` would be
        exceeded (then none is queued)."""
        with self._lock:
            if self.waiting + len(jobs) > self.max_queue:
                raise QueueFull(f"the server's queue is full ({self.max_queue} requests wait); retry later")
            self.waiting += len(jobs)
        self.metrics.queue_depth.set(self.waiting)
        self.commands.put(("submit", jobs))

    def cancel(self, jobs: list[Job]) -> None:
        """End ``jobs`` (a client went away): each frees its row at the next round boundary."""
        self.commands.put(("cancel", jobs))

    def close(self, timeout: float = 10.0) -> None:
        """Stop the thread; jobs still running fail."""
        self.commands.put(("stop", None))
        if self.compiler is not None:
            self.compiler.close()
        self.thread.join(timeout)

    # ------------------------------------------------------------------ the engine thread

    def _run(self) -> None:
        try:
            with self.gen.exclusive():
                self._make_recorded()
                self.ready.set()
                while True:
                    if not self._take_commands(block=not self.lanes):
                        break
                    for lane in list(self.lanes):
                        self._step(lane)
                    self.lanes = [lane for lane in self.lanes if lane.open]
        except Exception as e:  # the thread's last word: every job still known fails with one line
            self.failed = _one_line(e)
            self.ready.set()
        for lane in self.lanes:
            for job, _ in lane.jobs.values():
                job.emit(Failed(self.failed or "the server is shutting down"))

    def _take_commands(self, block: bool) -> bool:
        """Apply the queued commands (waiting for one when ``block``); False once told to stop. The
        requests that arrived together are placed together (``_place``), so a new lane fits all of them."""
        arrived: list[Job] = []
        while True:
            try:
                kind, jobs = self.commands.get(timeout=0.5) if block else self.commands.get_nowait()
            except queue.Empty:
                if block:
                    continue
                break
            if kind == "stop":
                return False
            if kind == "compile":
                self._take_over(*jobs)
            elif kind == "cancel":
                for job in jobs:
                    if job in arrived:
                        arrived.remove(job)
                        self._started(1)
                        self.metrics.requests.labels(status="cancelled").inc()
                    else:
                        self._cancel(job)
            else:
                arrived += jobs
            block = False
        forms: dict[tuple, list[Job]] = {}
        for job in arrived:
            forms.setdefault(form_of(job.call), []).append(job)
        for form, jobs in forms.items():
            self._place(form, jobs)
        return True

    def _place(self, form: tuple, jobs: list[Job]) -> None:
        """Give each of ``jobs`` (one form) a lane: the largest one of its form with a free row, else a new
        lane sized for every request of the form (these and those in lanes that take more; a draining lane's
        rows end with their requests), or the full one of that size."""
        for at, job in enumerate(jobs):
            try:
                mine = [lane for lane in self.lanes if lane.form == form and lane.taking]  # draining ones not
                lane = max((lane for lane in mine if lane.free > 0), key=lambda lane: lane.scheduler.rows, default=None)
                if lane is None:
                    demand = len(jobs) - at + sum(lane.scheduler.rows - lane.free for lane in mine)
                    session = self._session_for(job.call, min(self.max_batch, demand))
                    lane = next((lane for lane in mine if lane.session is session), None) or self._open(form, session)
                c = job.call  # its prompt ids come on the CPU (made by the event loop's thread): moved here
                prompt = c.prompt_ids.to(self.gen.target.device)
                index = lane.scheduler.submit(Request(prompt, c.max_new_tokens, c.rule, c.seed, c.stats))
                lane.jobs[index] = (job, TextOutput(self.gen.tokenizer, self.gen.eos_ids, c, job.streaming))
            except Exception as e:  # e.g. no memory for a new session: this request fails alone
                self._started(1)
                self.metrics.requests.labels(status="error").inc()
                job.emit(Failed(_one_line(e)))

    def _session_for(self, call: PreparedCall, rows: int) -> Session:
        """The session a new lane of ``call``'s form on ``rows`` rows opens on: the generator's, or with
        ``compile`` the compiled one once handed over, else the graph one (asking for the compiled one)."""
        if self.compiler is None:
            return self.gen.session_for(call, rows)
        key = key_of(call, rows)
        if key in self.compiled:
            return self.compiled[key]
        if self.recorded.pop(key, None) is not None:  # saved by an earlier server: made here between rounds
            self.loading.add(key)
            self.commands.put(("compile", (key, call, rows, 0.0, True)))
        elif key not in self.loading:
            self.compiler.ask(key, call, rows)
        return self.gen.session_for(call, rows, compiled=False)

    def _cache_ready(self, key: tuple, call: PreparedCall, rows: int, seconds: float) -> None:
        """Called on the compiler's thread: ``key``'s compile cache is warm (it took ``seconds``)."""
        self.commands.put(("compile", (key, call, rows, seconds, False)))

    def _make_recorded(self) -> None:
        """Before the server answers: make the compiled sessions of the configurations recorded by earlier
        servers from saved functions alone, the newest first, while ``PREBUILD_SECONDS`` allow (the time the
        last one took is the estimate for the next); the others wait in ``recorded`` for a lane of theirs.
        With nothing recorded (a first start), the compiling process starts loading at once, since the first
        request of each configuration will ask for it; else it starts at the first ask, if one comes (a
        restart whose configurations were all saved holds no second model on the device)."""
        if self.compiler is None:
            return
        entries = [entry for entry in recorded(self.records) if entry.rows <= session_rows(self.max_batch)]
        if not entries:
            self.compiler.start()
        start, last = time.perf_counter(), 0.0
        for entry in entries:
            key = key_of(entry.call, entry.rows)
            if key in self.compiled or key in self.recorded:
                continue
            if time.perf_counter() - start + last > PREBUILD_SECONDS:
                self.recorded[key] = entry
                continue
            began = time.perf_counter()
            self._take_over(key, entry.call, entry.rows, 0.0, saved_only=True)
            last = time.perf_counter() - began

    def _take_over(self, key: tuple, call: PreparedCall, rows: int, seconds: float, saved_only: bool) -> None:
        """Make ``key``'s compiled session here, between rounds (the running lanes wait meanwhile), record it,
        and let the graph lanes of ``key`` drain; a failure leaves ``key`` on graph rounds, with one line on
        stderr. ``seconds``: how long its compile cache took to get warm. ``saved_only``: from saved compiled
        functions alone; if they are not all there, ``key`` goes to the compiling process at once (at start
        too: a recorded configuration is likely to be asked for)."""
        self.loading.discard(key)
        if key in self.compiled:
            return
        start = time.perf_counter()
        try:
            with loads_only() if saved_only else contextlib.nullcontext():
                session = self.make_compiled(call, rows)
        except Exception as e:
            self.gen.forget_session(call, rows, compiled=True)  # half made: the next attempt starts afresh
            if isinstance(e, NotSaved):
                print(f"fsd-eagle: compiled rounds for {session_rows(rows)} rows not all saved ({e}); compiling them",
                      file=sys.stderr)
                self.compiler.ask(key, call, rows)
            else:
                print(f"fsd-eagle: compiled rounds for {session_rows(rows)} rows not used: {_one_line(e)}",
                      file=sys.stderr)
            return
        here = time.perf_counter() - start
        self.compiled[key] = session
        self.metrics.compiled_sessions.set(len(self.compiled))
        self.metrics.compile_seconds.inc(seconds + here)
        how = "from saved functions" if saved_only else f"cache warm after {seconds:.1f} s, session made here"
        print(f"fsd-eagle: compiled rounds for {session_rows(rows)} rows in use ({how} in {here:.1f} s)", file=sys.stderr)
        self._record(key, call, rows)
        for lane in self.lanes:
            if key_of_lane(lane) == key and lane.session is not session:
                lane.draining = True

    def _record(self, key: tuple, call: PreparedCall, rows: int) -> None:
        """Record ``key`` for the next server; a folder that cannot be written costs a restart its head start
        alone (one line on stderr)."""
        if self.records is None:
            return
        try:
            record(self.records, call, rows, key)
        except OSError as e:
            print(f"fsd-eagle: configuration not recorded for the next start: {_one_line(e)}", file=sys.stderr)

    def _open(self, form: tuple, session: Session) -> _Lane:
        rows = min(self.max_batch, session.batch)
        scheduler = Scheduler(session, [], rows, open_ended=True, max_len=Scheduler.cache_for(session, self.context))
        lane = _Lane(form, session, scheduler, scheduler.run())
        self.lanes.append(lane)
        return lane

    def _cancel(self, job: Job) -> None:
        for lane in self.lanes:
            for index, (j, _) in list(lane.jobs.items()):
                if j is job:
                    if index in lane.scheduler.waiting:
                        self._started(1)
                    lane.scheduler.finish(index)
                    del lane.jobs[index]
                    self.metrics.requests.labels(status="cancelled").inc()

    def _started(self, count: int) -> None:
        with self._lock:
            self.waiting -= count
        self.metrics.queue_depth.set(self.waiting)

    def _step(self, lane: _Lane) -> None:
        """Run ``lane`` to its next round boundary, delivering what it yields."""
        if not lane.open:
            return
        waiting_before = len(lane.scheduler.waiting)
        try:
            for item in lane.steps:
                if item is ROUND_END:
                    break
                self._deliver(lane, *item)
        except Exception as e:  # a failed round fails the requests of its lane alone; the lane starts afresh
            message = _one_line(e)
            for job, _ in lane.jobs.values():
                job.emit(Failed(message))
                self.metrics.requests.labels(status="error").inc()
            self._started(len(lane.scheduler.waiting))
            lane.jobs.clear()
            lane.failed = True  # the lane closes; its session is kept for the next lane of its form
            return
        self._started(waiting_before - len(lane.scheduler.waiting))
        self.metrics.rounds.inc()
        self.metrics.set_running(sum(lane.scheduler.running for lane in self.lanes))

    def _deliver(self, lane: _Lane, index: int, tokens: list[int]) -> None:
        entry = lane.jobs.get(index)
        if entry is None:  # cancelled (``_cancel`` finished it): its row frees itself
            return
        job, output = entry
        now = time.perf_counter()
        if job.first_at is None:
            job.first_at = now
            self.metrics.time_to_first_token.observe(now - job.submitted_at)
        elif tokens:
            gap = (now - job.last_at) / len(tokens)
            for _ in tokens:
                self.metrics.inter_token_latency.observe(gap)
        job.last_at = now
        for item in output.take(tokens, lane.scheduler, index):
            if isinstance(item, str):
                job.emit(Piece(item))
            else:
                del lane.jobs[index]
                self.metrics.count_result(len(job.call.prompt_ids), item)
                job.emit(Done(item))


def key_of_lane(lane: _Lane) -> tuple:
    return lane.form, lane.session.batch


def _one_line(error: BaseException) -> str:
    oom = out_of_memory_line(error, "lower --max-batch or the requests' max_tokens")
    return oom or " ".join(f"{type(error).__name__}: {error}".split())[:500]


def emitter(loop: asyncio.AbstractEventLoop, inbox: asyncio.Queue) -> Callable[[Event], None]:
    """An ``emit`` for a Job that puts its events on ``inbox``, an asyncio queue of ``loop``."""
    def emit(event: Event) -> None:
        loop.call_soon_threadsafe(inbox.put_nowait, event)
    return emit

"""Compiled rounds made beside serving: the server answers on CUDA-graph rounds from the start, while this
thread compiles and captures the session of each configuration it meets, then hands it to the engine.

A configuration is a rule form and a batch bucket (``Key``): what a session's code depends on. The first
time a lane of one opens, the engine asks for it (``ask``); this thread takes the generator's compiled
session for it (``SpeculativeGenerator.session_for(..., compiled=True)``), runs one short decode on it
with every row busy (``warm``: that compiles the prefill and the round with torch.compile and captures
both as CUDA graphs, minutes on a cold compile cache, seconds on a warm one) and hands it over
(``handover(key, session, seconds)``). The engine then opens new lanes of that configuration on the
compiled session and lets the graph lane drain: each request decodes in one mode from its start to its
end. A round that inductor cannot compile falls back inside the session (to graph rounds, as ``Session``
does); a warm-up that raises leaves the configuration on its graph session, with one line on stderr.

CUDA graphs are captured in thread-local mode (``decode.capture``), so the engine thread replays and
syncs its own graphs while this thread captures.
"""

from __future__ import annotations

import queue
import sys
import threading
import time
from typing import Callable

from ..api import PreparedCall, SpeculativeGenerator
from ..decode import DecodeStats, failure
from ..schedule import Request, Scheduler
from ..session import Session

Key = tuple  # (form_of(call), batch bucket)
WARM_PROMPT_TOKENS = 8  # of the asking request's prompt: a warm-up decode needs a prompt, not that one
WARM_NEW_TOKENS = 24  # a prefill and a few rounds: every row runs a captured round at least once


def warm(session: Session, call: PreparedCall) -> None:
    """Decode a few tokens on every row of ``session`` under ``call``'s rule (the start of ``call``'s prompt,
    seed 0): the session compiles and captures what its later calls replay."""
    prompt = call.prompt_ids[:WARM_PROMPT_TOKENS].to(session.target.device)
    requests = [Request(prompt, WARM_NEW_TOKENS, call.rule, 0, DecodeStats()) for _ in range(session.batch)]
    for _ in Scheduler(session, requests, session.batch).run():
        pass


class Compiler:
    """The thread that makes compiled sessions, one configuration at a time, in the order asked."""

    def __init__(self, gen: SpeculativeGenerator, handover: Callable[[Key, Session, float], None],
                 make: Callable[[PreparedCall, int], Session] | None = None) -> None:
        """``handover(key, session, seconds)`` is called on this thread with each session made; ``make(call,
        rows)`` makes the session of a configuration (default: the generator's compiled one)."""
        self.gen, self.handover = gen, handover
        self.make = make or (lambda call, rows: gen.session_for(call, rows, compiled=True))
        self.asked: set[Key] = set()
        self.jobs: queue.SimpleQueue = queue.SimpleQueue()
        self.thread = threading.Thread(target=self._run, name="fsd-eagle-compiler", daemon=True)

    def start(self) -> None:
        self.thread.start()

    def ask(self, key: Key, call: PreparedCall, rows: int) -> None:
        """Make the compiled session of ``key`` (``call``'s form on ``rows`` rows), once per key."""
        if key not in self.asked:
            self.asked.add(key)
            self.jobs.put((key, call, rows))

    def close(self) -> None:
        self.jobs.put(None)

    def _run(self) -> None:
        while (job := self.jobs.get()) is not None:
            key, call, rows = job
            start = time.perf_counter()
            try:
                session = self.make(call, rows)
                warm(session, call)
            except Exception as e:  # the graph session keeps serving this configuration
                print(f"fsd-eagle: compiled rounds for {rows} rows not used: {failure(e)}", file=sys.stderr)
                continue
            self.handover(key, session, time.perf_counter() - start)

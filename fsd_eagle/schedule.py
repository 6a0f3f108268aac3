"""Continuous batching: prompts flow through a session's B rows; a row whose prompt has finished takes
the next waiting prompt at a round boundary, so the throughput of a prompt list does not wait for its
longest answer. Waiting prompts start shortest first (``start_order``), and prompts that start at one
boundary are prefilled together (``Session.start_rows``), so each padded prefill holds prompts of similar
lengths; with many rows, freed rows wait until a few of them can be refilled at once (``refill_at``),
since a prefill costs several rounds of the whole batch and k prompts prefill in about the time of one.

``Scheduler.run`` yields each prompt's new tokens as rounds complete; the caller decides when a prompt
ends early (EOS, a stop string: ``finish``), the scheduler ends it at its token budget. One host sync per
round (reading every row's accepted tokens at once).
"""

from __future__ import annotations

import time
from collections import deque
from dataclasses import dataclass, field
from typing import Iterator

import torch

from .decode import DecodeStats, plan_cache
from .errors import ConfigError
from .session import FirstToken, PendingRound, Session
from .verify import AcceptanceRule


ROUND_END = None  # what an open-ended Scheduler.run yields at a round boundary (see Scheduler.run)


@dataclass
class Request:
    """One prompt to decode: ids ``[L]`` on the device, its token budget, rule and seed; ``stats`` is
    filled as it decodes."""

    prompt_ids: torch.Tensor
    max_new_tokens: int
    rule: AcceptanceRule
    seed: int = 0
    stats: DecodeStats = field(default_factory=DecodeStats)


def start_order(lengths: list[int]) -> list[int]:
    """The order in which requests of prompt ``lengths`` take rows (their indices): shortest prompt first,
    ties in list order. Prompts that start at one boundary are prefilled in one padded forward, so taking
    them by length gives each forward prompts of similar lengths (in list order, a 40-token prompt refilled
    with a 1,400-token one pads to the longer); and the first tokens of short prompts come first."""
    return sorted(range(len(lengths)), key=lengths.__getitem__)


def refill_rows(rows: int) -> int:
    """Freed rows that a scheduler over ``rows`` rows refills together: 1 up to 15 rows, then rows / 8 (a
    row idles a few rounds, the batch saves most of a prefill per prompt)."""
    return max(1, rows // 8)


class Scheduler:
    """Decodes ``requests`` on ``session`` (whose plan fits every request's rule form), at most ``rows``
    (default: the session's B) at a time, in order of prompt length (``start_order``): rows are filled
    first to last, and freed rows take the next waiting requests once ``refill_at`` of them are free
    (default ``refill_rows``), or fewer when fewer requests wait or every row is free; requests that start
    together take their rows in list order. Rows past ``rows`` stay idle."""

    def __init__(self, session: Session, requests: list[Request], rows: int | None = None,
                 refill_at: int | None = None, open_ended: bool = False, max_len: int | None = None) -> None:
        self.session, self.requests = session, list(requests)
        self.rows = min(rows or session.batch, session.batch)
        self.refill_at = refill_at or refill_rows(self.rows)
        self.open_ended, self.max_len = open_ended, max_len
        self.finished: set[int] = set()  # requests the caller ended (EOS, stop string, a client gone)
        self.done: set[int] = set()  # requests whose row was released (or that ended before they started)
        self.produced = [0] * len(self.requests)
        self.started_at = [0.0] * len(self.requests)
        self.row_of: dict[int, int] = {}  # the row each started request decodes in
        self.waiting: deque[int] = deque(start_order([r.prompt_ids.shape[0] for r in self.requests]))
        self.running = 0  # rows decoding a request now

    def submit(self, request: Request) -> int:
        """Add ``request`` to an open-ended scheduler (``open_ended``; between two items of ``run``, from
        the thread that iterates it): it waits behind those submitted before it and starts at a round
        boundary. Returns its index. Its prompt and budget must fit the caches of ``max_len`` slots."""
        if not self.open_ended:
            raise ConfigError("submit() needs a Scheduler made with open_ended=True")
        index = len(self.requests)
        self.requests.append(request)
        self.produced.append(0)
        self.started_at.append(0.0)
        self.waiting.append(index)
        return index

    @staticmethod
    def cache_for(session: Session, context: int) -> int:
        """Cache slots per row of an open-ended scheduler on ``session`` that hold any request whose prompt
        and token budget add up to at most ``context`` tokens (graph prefills pad prompts: room for that)."""
        padding = max((session.prompt_slots(n) - n for n in range(1, context + 1)), default=0)
        return plan_cache(context + padding, 0, session.tree, 1)

    def fits(self, prompt_len: int, max_new_tokens: int) -> bool:
        """Whether a request of ``prompt_len`` tokens and ``max_new_tokens`` fits an open-ended scheduler's
        caches of ``max_len`` slots."""
        s = self.session
        return plan_cache(s.prompt_slots(prompt_len), max_new_tokens, s.tree, 1) <= (self.max_len or 0)

    @property
    def idle(self) -> bool:
        """No request decoding or waiting."""
        return not self.waiting and not self.running

    def finish(self, index: int) -> None:
        """End request ``index`` after the tokens just yielded (its later tokens are dropped); a request
        still waiting leaves the queue at once."""
        self.finished.add(index)
        if index in self.waiting:
            self.waiting.remove(index)
            self.done.add(index)

    def run(self) -> Iterator[tuple[int, list[int]] | None]:
        """Yield (request index, new token ids) as rounds complete: a request's first token comes from its
        prefill, then each round adds at most depth + 1. At most ``max_new_tokens`` tokens per request.

        An ``open_ended`` scheduler never returns: it allocates caches of ``max_len`` slots once, and after
        each round, and whenever it has nothing to decode, it yields ``ROUND_END`` (None), where its driver
        may ``submit`` requests, ``finish`` them, run other schedulers, or wait (while ``idle``) before it
        resumes.

        With graph rounds the next round is launched before this one is read (so the host reads and
        detokenizes while the GPU computes), unless every decoding row may end in this round (a round
        computed in vain costs a whole round; waiting costs a launch). A request that ends while a round is
        in flight loses that round's tokens (dropped); its row is refilled after that round."""
        s, reqs, waiting = self.session, self.requests, self.waiting
        if self.open_ended:
            if not self.max_len:
                raise ConfigError("an open-ended Scheduler needs max_len (cache slots per row)")
            s.allocate(self.max_len)
        elif not reqs:
            return
        else:
            granularity = 2048 if s.target.device.type == "cuda" else 256
            s.allocate(max(plan_cache(s.prompt_slots(r.prompt_ids.shape[0]), r.max_new_tokens, s.tree, granularity)
                           for r in reqs))
        owner: list[int | None] = [None] * self.rows
        most = min(s.tree.depth, s.tree.total_tokens - 1) + 1 if s.drafter is not None else 1
        ahead: tuple[PendingRound, tuple] | None = None
        while True:
            started: list[tuple[int, int, FirstToken]] = []
            free = [row for row in range(self.rows) if owner[row] is None]
            if waiting and free and (len(free) >= min(self.refill_at, len(waiting)) or len(free) == self.rows):
                rows = free[:len(waiting)]
                take = sorted(waiting.popleft() for _ in rows)  # rows in list order
                now = time.perf_counter()
                for row, i in zip(rows, take):
                    self.started_at[i], self.row_of[i], owner[row] = now, row, i
                firsts = s.start_rows(rows, [reqs[i].prompt_ids for i in take], [reqs[i].rule for i in take],
                                      [reqs[i].seed for i in take])
                started = list(zip(rows, take, firsts))
            busy = [i for i in owner if i is not None]
            self.running = len(busy)
            if not busy:
                if not self.open_ended:
                    return
                yield ROUND_END  # idle: the driver submits a request (or waits for one) before resuming
                continue
            current = ahead or (s.launch(), tuple(owner))
            may_continue = any(self.produced[i] + most < reqs[i].max_new_tokens for i in busy)
            ahead = (s.launch(), tuple(owner)) if s.use_graph and may_continue else None
            for row, i, first in started:
                token = first.read()
                st = reqs[i].stats
                st.prefill_s = time.perf_counter() - self.started_at[i]
                st.mode, st.attention = s.mode, s.attention
                yield from self._deliver(i, [token], row, owner)
            rounds, owners = current
            for row, (result, i) in enumerate(zip(rounds.results(), owners)):
                if i is None or i in self.done:
                    continue
                st = reqs[i].stats
                st.fuzzy_accepted += result.fuzzy_extra
                st.divergence_count += result.div_count
                st.divergence_sum += result.div_sum
                st.accept_lengths.append(result.n_accepted)
                st.mode, st.attention = s.mode, s.attention
                yield from self._deliver(i, result.tokens, row, owner)
            if self.open_ended:
                self.running = sum(i is not None for i in owner)
                yield ROUND_END

    def _deliver(self, i: int, tokens: list[int], row: int, owner: list) -> Iterator[tuple[int, list[int]]]:
        """Count a target forward and the tokens of request ``i`` (clipped to its budget), yield them, and
        release its row if it has ended."""
        req, st = self.requests[i], self.requests[i].stats
        new = tokens[: req.max_new_tokens - self.produced[i]]
        self.produced[i] += len(new)
        st.target_forwards += 1
        st.new_tokens += len(new)
        st.elapsed_s = time.perf_counter() - self.started_at[i]
        yield i, new
        if i in self.finished or self.produced[i] >= req.max_new_tokens:
            self.done.add(i)
            owner[row] = None
            self.session.stop(row)


def decode(session: Session, prompt_ids: torch.Tensor, max_new_tokens: int, rule: AcceptanceRule,
           seed: int = 0, stats: DecodeStats | None = None) -> Iterator[list[int]]:
    """One prompt ``[L]`` on ``session`` (row 0): yield the new token ids of each round (the prefill's
    first token, then each round's); at most ``max_new_tokens`` in all. The caller may stop iterating at
    any point (EOS, a stop string). ``stats`` is filled as rounds complete."""
    if max_new_tokens < 1:
        return
    request = Request(prompt_ids, max_new_tokens, rule, seed, stats if stats is not None else DecodeStats())
    for _, tokens in Scheduler(session, [request], 1).run():
        yield tokens

"""Plans and sessions: how rounds run, and the state they run on.

A ``Plan`` is frozen: the tree, the rule form, whether to draft, the execution mode (CUDA graphs, compiled
rounds, preferred tree attention) and the batch size B. A ``Session`` carries out one plan over an
engine's weights: it owns the KV caches of B rows, the round state, and the graphs it captures, and it
runs rounds for all rows at once (``launch``), returning typed per-row results. Rows start prompts
(``start``) and stop (``stop``) independently, so a scheduler can refill a finished row while the others
decode (fsd_eagle.schedule).
"""

from __future__ import annotations

import functools
import time
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Iterable, Iterator

import torch

from . import compile_cache
from .config import TreeConfig
from .decode import (PREFILL_POW2_UP_TO, RoundResult, RoundState, capture, capture_first, compiled_prefill,
                     compiled_round, mark_batch_dynamic, prefill, prefill_bucket, round_attention, run_round)
from .drafter import DraftRoot, ModelDrafter, SlotDrafter
from .engine import Engine
from .errors import ConfigError
from .sampling import RuleForm
from .target import Target
from .trees_presets import BUCKETS

def session_rows(rows: int) -> int:
    """Rows a session gets for ``rows`` prompts decoded together: the next batch bucket (one captured graph
    and one compilation per bucket), at most the largest."""
    return next((b for b in BUCKETS if rows <= b), BUCKETS[-1])


@dataclass(frozen=True)
class Plan:
    """What a session runs: ``tree`` (drafting only if ``drafting`` and the tree drafts), the static rule
    ``form``, CUDA ``graphs`` and ``compile`` (on a GPU), the ``attention`` preferred for compiled rounds
    (None: FlexAttention where it applies) and the batch size. Calls that differ only in rule numbers,
    seeds or prompts share a plan, and so a session and its graphs."""

    tree: TreeConfig
    form: RuleForm
    drafting: bool = True
    graphs: bool = False
    compile: bool = False
    attention: str | None = None
    batch: int = 1


@dataclass
class HostCopy:
    """A device tensor on its way to the host: ``host`` (a pinned buffer filled asynchronously on CUDA) and
    the event recorded after the copy (None when the copy was synchronous)."""

    host: torch.Tensor
    event: torch.cuda.Event | None = None

    @classmethod
    def of(cls, tensor: torch.Tensor, buf: torch.Tensor | None = None):
        """Start copying ``tensor`` to the host (into ``buf``, a pinned buffer of its shape, if given)."""
        if not tensor.is_cuda:  # a static output buffer (``buf`` given: a replayed graph's) is read later: copied
            return cls(tensor.cpu() if buf is None else buf.copy_(tensor))
        buf = torch.empty(tensor.shape, dtype=tensor.dtype, pin_memory=True) if buf is None else buf
        buf.copy_(tensor, non_blocking=True)
        event = torch.cuda.Event()
        event.record()
        return cls(buf, event)

    def wait(self) -> torch.Tensor:
        """The host tensor, once its copy is done (waits for this copy only, not for later work)."""
        if self.event is not None:
            self.event.synchronize()
        return self.host


class StageClock:
    """Time a Session spends in its two kinds of work while running (``start`` .. ``stop``): prefills (each
    group of prompts started together) and rounds (each ``launch``). On CUDA each piece is bracketed by two
    timing events on the stream, so a span is the device's time from reaching the first to reaching the
    second (the work itself, not the host's), read only in ``totals`` (one sync at the end); on the CPU,
    where work runs as it is issued, by the host clock. For benchmarks that split a run's wall time into
    prefills, rounds and the rest (host work the device waited for, idle rows); off by default (two events
    per round)."""

    KINDS = ("prefill", "round")

    def __init__(self) -> None:
        self.running = False
        self.spans: dict[str, list] = {k: [] for k in self.KINDS}

    def start(self) -> None:
        """Forget earlier spans and time from now on."""
        self.spans = {k: [] for k in self.KINDS}
        self.running = True

    def stop(self) -> None:
        self.running = False

    @contextmanager
    def span(self, kind: str, device: torch.device) -> Iterator[None]:
        """Time the work issued inside the block as one piece of ``kind`` (nothing while not running)."""
        if not self.running:
            yield
            return
        if device.type == "cuda":
            begin, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            begin.record()
            yield
            end.record()
            self.spans[kind].append((begin, end))
        else:
            t = time.perf_counter()
            yield
            self.spans[kind].append(time.perf_counter() - t)

    def totals(self) -> dict[str, float | int]:
        """``<kind>s`` (how many) and ``<kind>_s`` (seconds in all) of each kind timed since ``start``."""
        out: dict[str, float | int] = {}
        for kind, spans in self.spans.items():
            if spans and isinstance(spans[0], tuple):
                spans[-1][1].synchronize()
                seconds = sum(b.elapsed_time(e) for b, e in spans) / 1e3
            else:
                seconds = float(sum(spans))
            out[f"{kind}s"], out[f"{kind}_s"] = len(spans), seconds
        return out


class PendingRound(HostCopy):
    """A launched round's packed output ``[B, 4 + P]`` (see ``decode.pack_round``) on its way to the host."""

    def results(self) -> list[RoundResult]:
        """One RoundResult per batch row."""
        return [RoundResult.unpack(row) for row in self.wait().tolist()]


@dataclass
class FirstToken:
    """A prompt's first token (from its prefill) on its way to the host: entry ``index`` of ``copy`` (the
    first tokens of the prompts prefilled together)."""

    copy: HostCopy
    index: int = 0

    def read(self) -> int:
        return int(self.copy.wait()[self.index])


# Prompts that a batch Session prefills together at most: a prefill of a few hundred tokens is bound by
# kernel launches, not arithmetic, so k prompts in one padded [k, L] forward cost about what one does.
PREFILL_GROUP = 8


def prefill_sizes(batch: int) -> tuple[int, ...]:
    """Rows of the PrefillRows that a Session of ``batch`` rows prefills into: the powers of two below the
    most prompts it prefills together, ``min(batch, PREFILL_GROUP)``, and that number itself (1, 2, 4, 8 for
    8 rows or more). k prompts then take a forward of fewer than 2k rows: a long prompt refilled with one or
    two others pads 2 or 4 rows to its length, not 8. A one-row Session prefills into its own row."""
    top = min(batch, PREFILL_GROUP)
    return tuple(sorted({1 << i for i in range(top.bit_length())} | {top}))


def prefill_rows_for(prompts: int, sizes: tuple[int, ...]) -> int:
    """The fewest rows among ``sizes`` (``prefill_sizes``) that hold ``prompts`` prompts."""
    return min(s for s in sizes if s >= prompts)


def prefill_groups(lengths: list[int], most: int) -> list[list[int]]:
    """The prompts of ``lengths`` (their indices) in the groups that are prefilled together, at most
    ``most`` a group: longest first (ties in their order), so that each group's prompts have similar
    lengths (a group pads every row to its longest prompt), and where the group's longest prompt is long
    enough for padding to cost arithmetic (over PREFILL_POW2_UP_TO tokens), a prompt less than half as long
    starts a group of its own: no prompt is padded to more than twice its length or PREFILL_POW2_UP_TO
    tokens (a 10,000-token prompt prefills alone, not with three short ones padded to it; short prompts,
    whose prefill costs launches, still share one)."""
    groups: list[list[int]] = []
    for i in sorted(range(len(lengths)), key=lambda i: -lengths[i]):
        longest = lengths[groups[-1][0]] if groups else 0
        if groups and len(groups[-1]) < most and (longest <= PREFILL_POW2_UP_TO or 2 * lengths[i] >= longest):
            groups[-1].append(i)
        else:
            groups.append([i])
    return groups


@dataclass
class PrefillRows:
    """A target, drafter and round state of ``rows`` rows that prompts are prefilled into before they are
    copied into their session rows (in a one-row session, the session's own)."""

    target: Target
    drafter: SlotDrafter | None
    state: RoundState

    @property
    def rows(self) -> int:
        return self.state.root_token.shape[0]


class Session:
    """Runs one Plan over an engine: B rows, each decoding its own prompt with its own rule numbers and
    seed, in one target forward and one draft pass per round for all rows.

    Rounds run eagerly, or on CUDA by replaying a captured graph of ``decode.run_round`` (compiled first with
    ``plan.compile``); if a compiled round cannot be captured with FlexAttention it is tried with SDPA, then
    uncompiled; where nothing captures, rounds run eagerly with the same outputs. Prompts are prefilled alone
    or up to PREFILL_GROUP together into caches of their own (``prefill_sizes`` rows; padded to one length,
    ``decode.prefill_bucket``; a graph captured per row count and padded length) and copied into their rows
    (with B = 1 the row itself). In graph mode ``launch`` returns before the round ends, so the host can read
    one round while the GPU runs the next.
    """

    def __init__(self, engine: Engine, plan: Plan) -> None:
        self.engine, self.plan = engine, plan
        self.batch = plan.batch
        self.target = engine.new_target()
        self.drafting = plan.drafting and plan.tree.drafts and engine.has_drafter
        self.drafter = engine.new_drafter(self.target) if self.drafting else None
        self.form = plan.form if self.drafting else plan.form.exact()
        dev = self.target.device
        self.state = RoundState.create(dev, self.batch)
        # Where prompts are prefilled, by rows: a one-row Session prefills straight into its row; a batch
        # Session into the PrefillRows of the fewest rows that hold them (``prefill_sizes``), then copies
        # them over.
        self.prefill_rows: dict[int, PrefillRows] = {}
        if self.batch == 1:
            self.prefill_rows[1] = PrefillRows(self.target, self.drafter, self.state)
        else:
            for k in prefill_sizes(self.batch):
                target = engine.new_target()
                drafter = engine.new_drafter(target) if self.drafting else None
                self.prefill_rows[k] = PrefillRows(target, drafter, RoundState.create(dev, k))
        self.row_ids = torch.arange(self.batch, device=dev)  # index tensors, made once
        self.use_graph = plan.graphs and dev.type == "cuda"
        self.compile = plan.compile and self.use_graph
        self.attention = round_attention(self.compile, self.target.config, plan.attention, self.batch)
        self.graph: tuple[torch.cuda.CUDAGraph, torch.Tensor] | None = None  # (graph, its output buffer)
        self.captured_for: tuple = ()
        self.host: list[torch.Tensor] = []  # two pinned output buffers, used in turn (two rounds in flight)
        self.turn = 0
        # Prefills by (rows, padded length): (ids buffer, length buffer, the prefill on them, its (graph,
        # outputs) or None where capture failed). Their graphs share one memory pool (``_prefill``).
        self.prefills: dict[tuple[int, int], tuple] = {}
        self.prefills_for: tuple = ()
        self.prefill_pool = None
        self.max_len = 0
        self.clock = StageClock()  # off unless a benchmark starts it

    @property
    def tree(self) -> TreeConfig:
        return self.plan.tree

    @property
    def mode(self) -> str:
        """How rounds run now: "compiled" (compiled, captured), "graph" (captured) or "eager"."""
        if not self.use_graph:
            return "eager"
        return "compiled" if self.compile else "graph"

    def prompt_slots(self, prompt_len: int) -> int:
        """Cache slots a prompt's prefill writes: its padded length in graph mode."""
        return prefill_bucket(prompt_len) if self.use_graph else prompt_len

    def allocate(self, max_len: int) -> None:
        """Caches of ``max_len`` slots per row (kept when big enough), every row stopped."""
        pairs = [(self.target, self.drafter, self.batch)]
        pairs += [(p.target, p.drafter, k) for k, p in self.prefill_rows.items() if p.target is not self.target]
        for target, drafter, batch in pairs:
            target.allocate(max_len, batch)
            if drafter is not None:
                drafter.allocate(max_len, self.tree, batch)
        self.max_len = self.target.cache.max_len
        self.state.active.zero_()

    def start(self, row: int, prompt_ids: torch.Tensor, rule, seed: int) -> FirstToken:
        """Start decoding ``prompt_ids`` ``[L]`` in ``row`` under ``rule`` (an AcceptanceRule of this plan's
        form) from ``seed``: prefill, then load the row. Returns the prompt's first token (read later: no
        host sync here). Enqueued after any round already launched."""
        return self.start_rows([row], [prompt_ids], [rule], [seed])[0]

    def start_rows(self, rows: list[int], prompts: list[torch.Tensor], rules: list, seeds: list[int]
                   ) -> list[FirstToken]:
        """``start`` for several rows at once: prompts are prefilled in groups of similar lengths, at most
        PREFILL_GROUP a group (``prefill_groups``), each group in one padded forward of the fewest prefill
        rows that hold it. Every row's outputs are those of its prompt started alone. Returns the first
        tokens in the order of ``rows``."""
        firsts: list[FirstToken | None] = [None] * len(rows)
        for group in prefill_groups([p.shape[0] for p in prompts], max(self.prefill_rows)):
            with self.clock.span("prefill", self.target.device):
                got = self._start_group([rows[j] for j in group], [prompts[j] for j in group],
                                        [rules[j] for j in group], [seeds[j] for j in group])
            for j, first in zip(group, got):
                firsts[j] = first
        return firsts

    def _start_group(self, rows: list[int], prompts: list[torch.Tensor], rules: list, seeds: list[int]
                     ) -> list[FirstToken]:
        k = len(rows)
        pre = self.prefill_rows[prefill_rows_for(k, tuple(self.prefill_rows))]
        for j, (rule, seed) in enumerate(zip(rules, seeds)):
            pre.state.values.set(rule, j)
            pre.state.rng.reseed(seed, j)
        root_token, root = self._prefill(pre, prompts)
        st = self.state
        if pre.target is self.target:  # one-row session: prefilled in place
            st.load_root(None, root_token, root)
            st.active.fill_(True)
        else:
            dst = torch.cat([self.row_ids[r:r + 1] for r in rows])  # [k] on the device, no host copy
            src = self.row_ids[:k]
            self.target.load_rows(dst, pre.target, src)
            if self.drafter is not None:
                self.drafter.load_rows(dst, pre.drafter, src)
            st.load_root(dst, root_token[:k], None if root is None else DraftRoot(root.logits[:k], root.state[:k]))
            for row, rule in zip(rows, rules):
                st.values.set(rule, row)
            st.rng.load_rows(dst, pre.state.rng, src)
            st.active.index_fill_(0, dst, True)
        copy = HostCopy.of(root_token[:k])
        return [FirstToken(copy, j) for j in range(k)]

    def prepare_prefills(self, prompt_lens: Iterable[int]) -> None:
        """In graph mode, capture now the prefill graph of every PrefillRows at the padded length of each of
        ``prompt_lens`` (prompt tokens), so that none is captured while prompts decode (a capture runs the
        prefill three times): e.g. before timing a run, whose refill groups depend on when rows finish. The
        caches must already be allocated for the run (graphs hold their addresses). Eagerly, nothing."""
        if not self.use_graph:
            return
        sizes = sorted({prefill_bucket(n) for n in prompt_lens})
        if sizes and sizes[-1] > self.max_len:
            raise ConfigError(f"prompts padded to {sizes[-1]} tokens do not fit caches of {self.max_len} slots: "
                              "allocate them first")
        for size in sizes:
            for pre in self.prefill_rows.values():
                self._prefill(pre, [torch.zeros(size, dtype=torch.long, device=self.target.device)])

    def stop(self, row: int) -> None:
        """Stop ``row``: its caches stop growing (its rounds still run, their results are ignored)."""
        self.state.active[row].fill_(False)

    def launch(self) -> PendingRound:
        """Start one round of every row; read its results with ``.results()``."""
        with self.clock.span("round", self.target.device):
            return self._launch()

    def _launch(self) -> PendingRound:
        if self.use_graph:
            caches = (self.target.cache, getattr(self.drafter, "cache", None), self.state.root_logits)
            if self.graph is None or any(a is not b for a, b in zip(caches, self.captured_for)):
                # (Re)capture: first use, or a cache was reallocated (the graph holds its addresses).
                self.graph = self._capture_round()
                self.captured_for = caches
                self.use_graph = self.graph is not None
            if self.graph is not None:
                graph, output = self.graph
                graph.replay()
                if len(self.host) != 2 or self.host[0].shape != output.shape:
                    self.host = [torch.empty(output.shape, dtype=output.dtype, pin_memory=output.is_cuda)
                                 for _ in range(2)]
                buf = self.host[self.turn]
                self.turn ^= 1
                return PendingRound.of(output, buf)
        self._apply_attention()
        return PendingRound.of(run_round(self.target, self.drafter, self.state, self.tree, self.form))

    def _prefill(self, pre: PrefillRows, prompts: list[torch.Tensor]) -> tuple[torch.Tensor, DraftRoot | None]:
        """``decode.prefill`` of up to ``pre.rows`` prompts (``[L_j]`` each) into ``pre``'s caches, padded to
        one length (rows past the prompts prefill a one-token dummy, never loaded): eagerly, or in graph mode
        by replaying the graph captured for the rows and padded length (the eager HF forward is ~25 ms of
        kernel launches on the H200). Returns the first tokens ``[rows]`` and draft roots.

        The prefill graphs share one memory pool, so that they hold about the memory of the largest, not of
        all of them (a graph per rows and padded length): prefills replay one at a time on one stream, and
        each one's outputs are copied out (``_start_group``: into the rows, the first tokens towards the
        host) before the next replays, so one graph's scratch memory may be another's outputs."""
        dev, rows = prompts[0].device, pre.rows
        form = self.form.exact()  # a prefill draws the first token: fuzzy settings play no part
        longest = max(p.shape[0] for p in prompts)
        if not self.use_graph:
            ids = torch.zeros(rows, longest, dtype=torch.long, device=dev)
            for j, p in enumerate(prompts):
                ids[j, :p.shape[0]].copy_(p)
            length = torch.tensor([p.shape[0] for p in prompts] + [1] * (rows - len(prompts)), device=dev)
            return prefill(pre.target, pre.drafter, ids, length, form, pre.state.values, pre.state.rng)
        caches = tuple(c for p in self.prefill_rows.values() for c in (p.target.cache, getattr(p.drafter, "cache", None)))
        if len(caches) != len(self.prefills_for) or any(a is not b for a, b in zip(caches, self.prefills_for)):
            self.prefills, self.prefills_for, self.prefill_pool = {}, caches, None  # graphs hold cache addresses
        key = (rows, prefill_bucket(longest))
        entry = self.prefills.get(key)
        ids, length = entry[:2] if entry else (torch.zeros(key, dtype=torch.long, device=dev),
                                               torch.zeros(rows, dtype=torch.long, device=dev))
        ids.zero_()
        length.fill_(1)
        for j, p in enumerate(prompts):
            ids[j, :p.shape[0]].copy_(p)
            length[j].fill_(p.shape[0])
        if entry is None:  # first prompts of this bucket: capture (warm-ups run on them)
            args = (pre.target, pre.drafter, ids, length, form, pre.state.values, pre.state.rng)
            fn = functools.partial(prefill, *args)
            # Compiled prefills cost ~30-60 s per rule form and drafter (Sessions of one plan share it:
            # _route_attention; a batch session's prefills of 2, 4 and 8 rows share one compilation with
            # the rows symbolic) and save about half of a prefill (4.0 of 7.3 ms for 128 tokens captured from
            # eager kernels on the H200): a batch refills a row whenever a prompt ends.
            compiled = self.compile
            if compiled:
                self._route_attention()
                torch._dynamo.maybe_mark_dynamic(ids, 1)  # the padded length: one compilation for every bucket
                if rows > 1:
                    mark_batch_dynamic(pre.target, pre.drafter, pre.state)
                    for t in (ids, length):
                        torch._dynamo.maybe_mark_dynamic(t, 0)
            candidates = ([functools.partial(compiled_prefill(), *args)] if compiled else []) + [fn]
            found = capture_first(candidates, self._prefill_state(pre), self.prefill_pool)
            if found is not None and self.prefill_pool is None:
                self.prefill_pool = found[0].pool()  # the first graph's pool, shared by the later ones
            if compiled and found is not None:
                compile_cache.store()
            entry = self.prefills[key] = (ids, length, fn, found)  # found None: this bucket runs eagerly
        _, _, fn, captured = entry
        if captured is None:
            return fn()
        graph, out = captured
        graph.replay()
        return out

    def _capture_round(self):
        """Capture the round: compiled with the session's attention, compiled with SDPA (e.g. inductor finds
        no FlexAttention kernel for this head size), then uncompiled with SDPA; the first that captures sets
        ``attention`` and ``compile``. None: nothing captured (rounds run eagerly, with SDPA). A batched
        Session's compiled round has its batch size symbolic (``compiled_round(True)`` marks this Session's
        tensors), so Sessions of other batch sizes reuse its compilation; a one-row round is static."""
        options = [(True, self.attention), (True, "sdpa")] if self.compile else []
        options = list(dict.fromkeys(options + [(False, "sdpa")]))
        if self.compile:
            self._route_attention()
        for compiled, backend in options:
            self.compile, self.attention = compiled, backend
            self._apply_attention()
            fn = compiled_round(self.batch > 1) if compiled else run_round
            found = capture(functools.partial(fn, self.target, self.drafter, self.state, self.tree, self.form),
                            self._round_state())
            if found is not None:
                if compiled:
                    compile_cache.store()
                return found
        return None

    def prepare_attention(self, backend: str) -> None:
        """Give this Session's rounds the tree attention ``backend`` ("sdpa" or "flex") with the models routed
        as before a compilation (``_route_attention``): for tools that compile ``decode.run_round`` themselves."""
        self.attention = backend
        self._route_attention()
        self._apply_attention()

    def _route_attention(self) -> None:
        """Before compiling: the models' attention runs through the registered function whatever the
        backend (``Target.route_attention``), so that every compilation (prefills of every Session, rounds
        with either backend) sees the same model config and no Session compiles a prefill again because an
        earlier Session's round switched the shared model to FlexAttention."""
        self.target.route_attention()
        if isinstance(self.drafter, ModelDrafter):
            self.drafter.model.route_attention()

    def _apply_attention(self) -> None:
        self.target.use_attention(self.attention)
        if isinstance(self.drafter, ModelDrafter):
            self.drafter.model.use_attention(self.attention)

    @staticmethod
    def _prefill_state(pre: PrefillRows) -> list[torch.Tensor]:
        """What a prefill changes besides cache rows (restored after capture warm-ups)."""
        d = pre.drafter
        return [pre.target.length, pre.state.rng.counter] + ([d.length] if d is not None else [])

    def _round_state(self) -> list[torch.Tensor]:
        """What a round changes besides cache rows past the prefixes (restored after capture warm-ups)."""
        st = self.state
        tensors = [self.target.length, st.root_token, st.rng.counter]
        if self.drafter is not None:
            tensors += [self.drafter.length, st.root_logits, st.root_state]
        return tensors

"""The decoding loop: prompt -> prefill -> draft tree -> verify (acceptance rule) -> commit -> repeat.

One host sync per round (reading the accepted tokens to detokenize and check stop conditions).
Plain autoregressive decoding is the same loop with no drafter: the tree is the root alone.
"""

from __future__ import annotations

import functools
import time
import warnings
from dataclasses import dataclass, field
from typing import Iterator

import torch

from .attention import flex_supported
from .config import TreeConfig
from .drafter import DraftRoot, ModelDrafter, SlotDrafter
from .ops import pick
from .rng import RandomStream
from .sampling import RuleForm, RuleValues, choose
from .target import Target
from .tree import DraftTree, draft_tree, root_tree
from .verify import AcceptanceRule, Verdict, verify_tree


@dataclass
class DecodeStats:
    """Per-call statistics. tau = new tokens / target forwards (the prefill counts as one forward)."""

    new_tokens: int = 0
    target_forwards: int = 0
    fuzzy_accepted: int = 0
    divergence_sum: float = 0.0
    divergence_count: int = 0
    elapsed_s: float = 0.0
    prefill_s: float = 0.0  # time to the first token (prefill of target and drafter)
    accept_lengths: list[int] = field(default_factory=list)
    mode: str = ""  # how the rounds ran: "eager", "graph" (CUDA graph replay) or "compiled" (compiled + graph)
    attention: str = ""  # the rounds' tree attention: "sdpa" or "flex"

    @property
    def tau(self) -> float:
        return self.new_tokens / self.target_forwards if self.target_forwards else 0.0

    @property
    def tokens_per_s(self) -> float:
        return self.new_tokens / self.elapsed_s if self.elapsed_s > 0 else 0.0

    @property
    def divergence_mean(self) -> float | None:
        return self.divergence_sum / self.divergence_count if self.divergence_count else None


def plan_cache(prompt_len: int, max_new_tokens: int, tree: TreeConfig, granularity: int = 256) -> int:
    """Cache slots a call needs: the prompt, the output, the last round's overshoot (up to depth + 1 tokens
    past max_new_tokens) and one more round in flight (its tree and padded path), rounded up to a multiple of
    ``granularity`` so that calls of similar size share one allocation, one captured graph and one compiled
    round (GPUs use 2048: attention over unused slots costs little there, a recompile costs seconds)."""
    round_rows = tree.total_tokens + tree.depth + 2
    need = prompt_len + max_new_tokens + tree.depth + 1 + round_rows
    return -(-need // granularity) * granularity


@dataclass
class RoundState:
    """What one round hands the next, as device tensors updated in place (a captured graph reads them):
    the root token (the target's last choice), the drafter's root logits ``[V]`` and state ``[s]``, and the
    call's rule numbers and random stream (set per call by ``RoundRunner.begin``)."""

    root_token: torch.Tensor
    values: RuleValues
    rng: RandomStream
    root_logits: torch.Tensor | None = None
    root_state: torch.Tensor | None = None

    @classmethod
    def create(cls, device: torch.device) -> "RoundState":
        return cls(torch.zeros((), dtype=torch.long, device=device), RuleValues.create(device),
                   RandomStream.create(device))


def prefill(target: Target, drafter: SlotDrafter | None, ids: torch.Tensor, n: torch.Tensor, form: RuleForm,
            values: RuleValues, rng: RandomStream) -> tuple[torch.Tensor, DraftRoot | None]:
    """Prompt -> both KV caches (emptied by ``allocate``). ids ``[Lb]``: the prompt in its first n entries
    (n a 0-dim tensor), padding after it, so that one captured graph serves every prompt of a bucket (the
    padding's cache rows lie past the prefix: masked, then overwritten). Returns the target's first token
    (0-dim; sampled with ``rng``'s step 0, which then advances) and the drafter's root (None without one)."""
    features = target.prefill(ids)
    target.length.copy_(n)
    root_token = choose(target.logits(pick(features, n - 1)[None])[0], form, values, rng)
    if not form.greedy:
        rng.advance()
    if drafter is None:
        return root_token, None
    tokens = torch.cat([ids, ids[:1]]).index_copy(0, n.reshape(1), root_token.reshape(1))
    return root_token, drafter.prefill(tokens, features, n)


def prefill_bucket(prompt_len: int) -> int:
    """Padded prompt length of a captured prefill: the next power of two, at least 64 (few graphs, each
    prefill at most twice its length: cheap, as a prefill's time is kernel launches, not arithmetic)."""
    return max(64, 1 << (prompt_len - 1).bit_length())


@dataclass
class RoundResult:
    """One round as the host reads it: ``n_accepted`` tokens (root included: the tokens this round adds),
    draft tokens accepted beyond the exact rule (``fuzzy_extra``), the sum and count of the divergences at
    the path's decision nodes, and ``tokens``, the round's new tokens (``n_accepted`` of them)."""

    n_accepted: int
    fuzzy_extra: int
    div_count: int
    div_sum: float
    tokens: list[int]

    # The packed device form (see ``pack_round``): these four, then the P = depth + 1 next tokens.
    FIELDS = ("n_accepted", "fuzzy_extra", "div_count", "div_sum")

    @classmethod
    def unpack(cls, packed: list[float]) -> "RoundResult":
        meta = dict(zip(cls.FIELDS, packed))
        n = int(meta["n_accepted"])
        tokens = [int(t) for t in packed[len(cls.FIELDS): len(cls.FIELDS) + n]]
        return cls(n, int(meta["fuzzy_extra"]), int(meta["div_count"]), meta["div_sum"], tokens)


def pack_round(verdict: Verdict, next_tokens: torch.Tensor) -> torch.Tensor:
    """``[4 + P]`` float64 (token ids are exact in float64): RoundResult.FIELDS, then the next tokens. One
    tensor, so that the host reads a round with one copy."""
    meta = torch.stack([verdict.n_accepted, verdict.fuzzy_extra, verdict.div_count]).double()
    return torch.cat([meta, verdict.div_sum.double().reshape(1), next_tokens.double()])


def run_round(target: Target, drafter: SlotDrafter | None, state: RoundState, tree_cfg: TreeConfig,
              form: RuleForm) -> torch.Tensor:
    """draft tree -> verify forward -> acceptance rule -> commit to both KV caches (and, when sampling,
    advance the random stream). Returns the packed round (``pack_round``; read with RoundResult.unpack)."""
    if drafter is not None:
        tree = draft_tree(drafter, state.root_token, state.root_logits, state.root_state, tree_cfg,
                          with_q=form.fuzzy)
    else:
        tree = root_tree(state.root_token)
    features = target.forward_tree(tree.tokens, tree.depths, tree.anc)
    verdict = verify_tree(tree, target.logits(features), form, state.values, state.rng)
    if not form.greedy:
        state.rng.advance()
    next_tokens = commit_round(target, drafter, state, tree, features, verdict)
    return pack_round(verdict, next_tokens)


def commit_round(target: Target, drafter: SlotDrafter | None, state: RoundState, tree: DraftTree,
                 features: torch.Tensor, verdict: Verdict) -> torch.Tensor:
    """Commit the accepted path to both KV caches and hand the next round its root (``state``, in place).
    features: the target's ``[n, h]`` over the tree. Returns the P next tokens (see ``_next_tokens``)."""
    target.commit(verdict.path, verdict.n_accepted)
    next_tokens = _next_tokens(tree, verdict)
    if drafter is not None:
        root = drafter.commit(next_tokens, features.index_select(0, verdict.path), verdict.n_accepted)
        state.root_logits.copy_(root.logits)
        state.root_state.copy_(root.state)
    state.root_token.copy_(verdict.bonus)
    return next_tokens


# Graphs dynamo may keep per compiled function: one per tree/rule form and cache size (rounds), per form
# and prompt bucket (prefills). Past its default limit of 8, dynamo silently runs the function eagerly,
# which the graph would capture as slow eager kernels (seen with 5 trees in one process).
RECOMPILE_LIMIT = 64


def _compile(fn):
    torch._dynamo.config.recompile_limit = max(torch._dynamo.config.recompile_limit, RECOMPILE_LIMIT)
    return torch.compile(fn, dynamic=False)


@functools.cache
def compiled_round():
    """``run_round`` compiled by inductor: fuses a round's many small kernels (norms, rotary, masks, tree
    bookkeeping, the sampling rule's random numbers; on the H200 a compiled round took 3.6 ms against 6.5 ms)
    before graph capture. dynamo recompiles per tree, rule form and cache shape, not per rule value."""
    return _compile(run_round)


@functools.cache
def compiled_prefill():
    """``prefill`` compiled by inductor, one graph per padded prompt length (dynamo recompiles per bucket).
    A 64-token prefill of SmolLM2-135M replayed in 6.6-6.9 ms on an H100 when captured from eager kernels,
    in 4.7-4.9 ms compiled."""
    return _compile(prefill)


def round_attention(compiled: bool, config, preferred: str | None = None) -> str:
    """The tree attention of a runner's rounds: FlexAttention only where the round is compiled (eager
    FlexAttention is a slow reference), and only for models it fits; else SDPA. ``preferred``: a user's
    choice ("sdpa" or "flex", None: flex where it applies, measured fastest for compiled GPU rounds)."""
    if compiled and preferred in (None, "flex") and flex_supported(config):
        return "flex"
    return "sdpa"


@dataclass
class PendingRound:
    """A round's packed output (see ``pack_round``) on its way to the host."""

    host: torch.Tensor  # on the CPU (a pinned buffer filled asynchronously in graph mode)
    event: torch.cuda.Event | None = None  # set when the copy is asynchronous

    def result(self) -> RoundResult:
        if self.event is not None:
            self.event.synchronize()  # waits for this round only, not for a round launched after it
        return RoundResult.unpack(self.host.tolist())


class RoundRunner:
    """Runs rounds for one (target, drafter, tree, rule form): eagerly, or on CUDA by replaying a captured
    graph of ``run_round`` (captured on first use, compiled first with ``compile``), for greedy and sampling
    forms alike; a call's rule numbers and seed are inputs of the graph (``begin``). If a compiled round
    cannot be captured with FlexAttention it is tried with SDPA, then uncompiled; where nothing captures,
    rounds run eagerly with the same outputs. In graph mode ``launch`` returns before the round ends, so the
    host can read one round while the GPU runs the next.

    ``attention``: the rounds' tree attention (default: ``round_attention``, i.e. FlexAttention only for
    compiled rounds). Keep one runner per configuration: its state buffers and its graphs are reused.
    """

    def __init__(self, target: Target, drafter: SlotDrafter | None, tree_cfg: TreeConfig, form: RuleForm,
                 use_graph: bool | None = None, compile: bool = False, attention: str | None = None) -> None:
        self.target, self.drafter, self.tree_cfg, self.form = target, drafter, tree_cfg, form
        dev = target.device
        self.state = RoundState.create(dev)
        self.use_graph = dev.type == "cuda" if use_graph is None else use_graph
        self.compile = compile and self.use_graph
        self.attention = attention or round_attention(self.compile, target.config)
        self.graph: tuple[torch.cuda.CUDAGraph, torch.Tensor] | None = None  # (graph, its output buffer)
        self.captured_for: tuple = ()
        self.host: list[torch.Tensor] = []  # two pinned output buffers, used in turn (two rounds in flight)
        self.turn = 0
        # Prefills by padded length: (ids buffer, length buffer, the prefill on them, its (graph, outputs)
        # or None where capture failed).
        self.prefills: dict[int, tuple] = {}
        self.prefills_for: tuple = ()

    def begin(self, rule, seed: int | None) -> None:
        """Set a call's rule numbers (an AcceptanceRule of this runner's form) and restart its random stream
        at ``seed`` (greedy rules draw nothing). In place, without a host sync."""
        self.state.values.set(rule)
        self.state.rng.reseed(0 if seed is None else seed)

    def prompt_slots(self, prompt_len: int) -> int:
        """Cache rows the prefill writes: the padded length in graph mode."""
        return prefill_bucket(prompt_len) if self.use_graph else prompt_len

    def prefill(self, prompt_ids: torch.Tensor):
        """``prefill`` of the prompt ``[L]`` (caches allocated): eagerly, or in graph mode by replaying the
        graph captured for its bucket (the eager HF forward is ~25 ms of kernel launches on the H200).
        Returns (root_token, root) as ``prefill``."""
        n = prompt_ids.shape[0]
        st = self.state
        form = self.form.exact()  # a prefill draws the first token: fuzzy settings play no part
        if not self.use_graph:
            return prefill(self.target, self.drafter, prompt_ids, torch.tensor(n, device=prompt_ids.device),
                           form, st.values, st.rng)
        caches = (self.target.cache, getattr(self.drafter, "cache", None))
        if any(a is not b for a, b in zip(caches, self.prefills_for)):
            self.prefills, self.prefills_for = {}, caches  # graphs hold cache addresses
        size = prefill_bucket(n)
        entry = self.prefills.get(size)
        ids, length = entry[:2] if entry else (torch.zeros(size, dtype=torch.long, device=prompt_ids.device),
                                               torch.zeros((), dtype=torch.long, device=prompt_ids.device))
        ids.zero_()
        ids[:n].copy_(prompt_ids)
        length.fill_(n)
        if entry is None:  # first prompt of this bucket: capture (warm-ups run on this prompt)
            args = (self.target, self.drafter, ids, length, form, st.values, st.rng)
            fn = functools.partial(prefill, *args)
            candidates = ([functools.partial(compiled_prefill(), *args)] if self.compile else []) + [fn]
            found = capture_first(candidates, self._prefill_state())
            entry = self.prefills[size] = (ids, length, fn, found)  # found None: this bucket runs eagerly
        _, _, fn, captured = entry
        if captured is None:
            return fn()
        graph, out = captured
        graph.replay()
        return out

    def start(self, root_token: torch.Tensor, root: DraftRoot | None) -> None:
        """Load the prefill's results into the persistent state."""
        st = self.state
        st.root_token.copy_(root_token)
        if root is not None:
            if st.root_logits is None or st.root_logits.shape != root.logits.shape:
                st.root_logits, st.root_state = root.logits.clone(), root.state.clone()
            st.root_logits.copy_(root.logits)
            st.root_state.copy_(root.state)

    def launch(self) -> PendingRound:
        """Start one round; its result is read with ``.result()``."""
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
                    self.host = [torch.empty(output.shape, dtype=output.dtype, pin_memory=True) for _ in range(2)]
                buf = self.host[self.turn]
                self.turn ^= 1
                buf.copy_(output, non_blocking=True)
                event = torch.cuda.Event()
                event.record()
                return PendingRound(buf, event)
        self._apply_attention()
        out = run_round(self.target, self.drafter, self.state, self.tree_cfg, self.form)
        return PendingRound(out.cpu())

    def _capture_round(self):
        """Capture the round: compiled with the runner's attention, compiled with SDPA (e.g. inductor finds
        no FlexAttention kernel for this head size), then uncompiled with SDPA; the first that captures
        sets ``attention`` and ``compile``. None: nothing captured (rounds run eagerly, with SDPA)."""
        options = [(True, self.attention), (True, "sdpa")] if self.compile else []
        options = list(dict.fromkeys(options + [(False, "sdpa")]))
        for compiled, backend in options:
            self.compile, self.attention = compiled, backend
            self._apply_attention()
            fn = compiled_round() if compiled else run_round
            found = capture(functools.partial(fn, self.target, self.drafter, self.state, self.tree_cfg, self.form),
                            self._round_state())
            if found is not None:
                return found
        return None

    @property
    def mode(self) -> str:
        """How rounds run now: "compiled" (compiled, captured), "graph" (captured) or "eager"."""
        if not self.use_graph:
            return "eager"
        return "compiled" if self.compile else "graph"

    def _apply_attention(self) -> None:
        self.target.use_attention(self.attention)
        if isinstance(self.drafter, ModelDrafter):
            self.drafter.model.use_attention(self.attention)

    def _prefill_state(self) -> list[torch.Tensor]:
        """What a prefill changes besides cache rows (restored after capture warm-ups)."""
        return [self.target.length, self.state.rng.counter] + ([self.drafter.length] if self.drafter else [])

    def _round_state(self) -> list[torch.Tensor]:
        """What a round changes besides cache rows past the prefix (restored after capture warm-ups)."""
        st = self.state
        tensors = [self.target.length, st.root_token, st.rng.counter]
        if self.drafter is not None:
            tensors += [self.drafter.length, st.root_logits, st.root_state]
        return tensors


def capture_first(candidates: list, state: list[torch.Tensor]):
    """(graph, outputs) of the first of ``candidates`` (functions without arguments) that captures; None if
    none does (see ``capture``)."""
    for fn in candidates:
        captured = capture(fn, state)
        if captured is not None:
            return captured
    return None


def capture(fn, state: list[torch.Tensor]) -> tuple[torch.cuda.CUDAGraph, object] | None:
    """Capture ``fn`` (a round, or a prefill) in a CUDA graph. Warm-up runs (which also compile a compiled
    ``fn``) go on a side stream and ``state`` is restored after each, so capturing changes nothing (a round
    only writes cache rows past the committed prefix). Returns (graph, fn's outputs), or None (eager fallback)
    if ``fn`` cannot be compiled or captured."""
    saved = [t.clone() for t in state]
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    try:
        with torch.cuda.stream(stream):
            for _ in range(2):
                fn()
                for t, v in zip(state, saved):
                    t.copy_(v)
        torch.cuda.current_stream().wait_stream(stream)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            out = fn()
    except RuntimeError as e:  # an op that syncs or is not capturable here; inductor errors are RuntimeErrors
        torch.cuda.synchronize()
        for t, v in zip(state, saved):
            t.copy_(v)
        warnings.warn(f"CUDA graph capture failed: {str(e).splitlines()[0]}")
        return None
    return graph, out


def decode(target: Target, drafter: SlotDrafter | None, prompt_ids: torch.Tensor, max_new_tokens: int,
           tree_cfg: TreeConfig, rule: AcceptanceRule, seed: int | None, stats: DecodeStats,
           runner: RoundRunner | None = None) -> Iterator[list[int]]:
    """Yield the new token ids of each round (the caller stops iterating on EOS / stop strings).

    prompt_ids ``[L]`` on the target's device. ``seed``: of the call's random stream (sampling rules; None
    is 0): the same seed, rule and prompt give the same tokens in every mode. ``stats`` is filled as rounds
    complete; at most ``max_new_tokens`` ids are yielded in total. ``runner``: a reusable RoundRunner for
    this configuration (default: a fresh eager one). With a graph runner, the next round is launched before
    this one is read unless this one may end the call (so a round is computed in vain only after an EOS or
    a stop string).
    """
    if max_new_tokens < 1:  # the prefill would already produce one token
        return
    drafting = drafter is not None and tree_cfg.drafts
    drafter = drafter if drafting else None
    form = rule.form if drafting else rule.form.exact()
    if runner is None:
        runner = RoundRunner(target, drafter, tree_cfg, form, use_graph=False, attention=target.attention)
    elif runner.form != form:
        raise ValueError(f"this runner decodes rule form {runner.form}, not {form}")
    start = time.perf_counter()
    runner.begin(rule, seed)
    granularity = 2048 if target.device.type == "cuda" else 256
    max_len = plan_cache(runner.prompt_slots(prompt_ids.shape[0]), max_new_tokens, tree_cfg, granularity)
    target.allocate(max_len)
    if drafting:
        drafter.allocate(max_len, tree_cfg)
    root_token, root = runner.prefill(prompt_ids)
    runner.start(root_token, root)
    # With a graph runner, the round launched ahead of the one read last (the first one before the prefill
    # is read).
    pending = runner.launch() if runner.use_graph and max_new_tokens > 1 else None
    stats.target_forwards += 1
    produced = 1
    stats.new_tokens += 1
    first = int(root_token)  # waits for the prefill
    stats.elapsed_s = stats.prefill_s = time.perf_counter() - start
    stats.mode, stats.attention = runner.mode, runner.attention
    yield [first]
    # A round yields at most ``most`` tokens: a round that may end the call gets no successor launched
    # ahead (computing one in vain costs a whole round; waiting costs only a launch).
    most = min(tree_cfg.depth, tree_cfg.total_tokens - 1) + 1 if drafting else 1
    while produced < max_new_tokens:
        current = pending or runner.launch()
        ahead = runner.use_graph and produced + most < max_new_tokens
        pending = runner.launch() if ahead else None
        result = current.result()  # the round's only host sync
        new = result.tokens[: max_new_tokens - produced]
        produced += len(new)
        stats.target_forwards += 1
        stats.new_tokens += len(new)
        stats.fuzzy_accepted += result.fuzzy_extra
        stats.divergence_count += result.div_count
        stats.divergence_sum += result.div_sum
        stats.accept_lengths.append(result.n_accepted)
        stats.elapsed_s = time.perf_counter() - start
        stats.mode, stats.attention = runner.mode, runner.attention
        yield new


def _next_tokens(tree: DraftTree, verdict: Verdict) -> torch.Tensor:
    """``[P]``: the token after each accepted path node (the next accepted draft, then the bonus)."""
    nxt = torch.cat([tree.tokens[verdict.path[1:]], verdict.bonus.reshape(1)])
    return nxt.scatter(0, (verdict.n_accepted - 1).reshape(1), verdict.bonus.reshape(1))

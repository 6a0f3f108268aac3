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

from .config import SamplingConfig, TreeConfig
from .drafter import DraftRoot, ModelDrafter, SlotDrafter
from .ops import pick
from .sampling import choose
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
    the root token (the target's last choice), and the drafter's root logits ``[V]`` and state ``[s]``."""

    root_token: torch.Tensor
    root_logits: torch.Tensor | None = None
    root_state: torch.Tensor | None = None


def prefill(target: Target, drafter: SlotDrafter | None, ids: torch.Tensor, n: torch.Tensor,
            sampling: SamplingConfig, generator: torch.Generator | None) -> tuple[torch.Tensor, DraftRoot | None]:
    """Prompt -> both KV caches (emptied by ``allocate``). ids ``[Lb]``: the prompt in its first n entries
    (n a 0-dim tensor), padding after it, so that one captured graph serves every prompt of a bucket (the
    padding's cache rows lie past the prefix: masked, then overwritten). Returns the target's first token
    (0-dim) and the drafter's root (None without a drafter)."""
    features = target.prefill(ids)
    target.length.copy_(n)
    root_token = choose(target.logits(pick(features, n - 1)[None])[0], sampling, generator)
    if drafter is None:
        return root_token, None
    tokens = torch.cat([ids, ids[:1]]).index_copy(0, n.reshape(1), root_token.reshape(1))
    return root_token, drafter.prefill(tokens, features, n)


def prefill_bucket(prompt_len: int) -> int:
    """Padded prompt length of a captured prefill: the next power of two, at least 64 (few graphs, each
    prefill at most twice its length: cheap, as a prefill's time is kernel launches, not arithmetic)."""
    return max(64, 1 << (prompt_len - 1).bit_length())


def run_round(target: Target, drafter: SlotDrafter | None, state: RoundState, tree_cfg: TreeConfig,
              rule: AcceptanceRule, generator: torch.Generator | None) -> torch.Tensor:
    """draft tree -> verify forward -> acceptance rule -> commit to both KV caches.

    Returns ``[4 + P]`` float64 (token ids are exact in float64): n_accepted, fuzzy_extra, div_count,
    div_sum, then the P = depth + 1 next tokens (the first n_accepted are this round's new tokens).
    """
    if drafter is not None:
        tree = draft_tree(drafter, state.root_token, state.root_logits, state.root_state, tree_cfg,
                          with_q=rule.fuzzy.active)
    else:
        tree = root_tree(state.root_token)
    features = target.forward_tree(tree.tokens, tree.depths, tree.anc)
    verdict = verify_tree(tree, target.logits(features), rule, generator)
    next_tokens = commit_round(target, drafter, state, tree, features, verdict)
    meta = torch.stack([verdict.n_accepted, verdict.fuzzy_extra, verdict.div_count]).double()
    return torch.cat([meta, verdict.div_sum.double().reshape(1), next_tokens.double()])


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


# Graphs dynamo may keep per compiled function: one per tree/rule configuration and cache size (rounds),
# per configuration and prompt bucket (prefills). Past its default limit of 8, dynamo silently runs the
# function eagerly, which the graph would capture as slow eager kernels (seen with 5 trees in one process).
RECOMPILE_LIMIT = 64


def _compile(fn):
    torch._dynamo.config.recompile_limit = max(torch._dynamo.config.recompile_limit, RECOMPILE_LIMIT)
    return torch.compile(fn, dynamic=False)


@functools.cache
def compiled_round():
    """``run_round`` compiled by inductor: fuses a round's many small kernels (norms, rotary, masks, tree
    bookkeeping; on the H200 a compiled round took 3.6 ms against 6.5 ms) before graph capture. dynamo
    recompiles per tree/rule configuration and cache shape."""
    return _compile(run_round)


@functools.cache
def compiled_prefill():
    """``prefill`` compiled by inductor, one graph per padded prompt length (dynamo recompiles per bucket).
    A 64-token prefill of SmolLM2-135M replayed in 6.6-6.9 ms on an H100 when captured from eager kernels,
    in 4.7-4.9 ms compiled."""
    return _compile(prefill)


@dataclass
class PendingRound:
    """A round's output ``[4 + P]`` (see ``run_round``) on its way to the host."""

    host: torch.Tensor  # on the CPU (a pinned buffer filled asynchronously in graph mode)
    event: torch.cuda.Event | None = None  # set when the copy is asynchronous

    def result(self) -> list[float]:
        if self.event is not None:
            self.event.synchronize()  # waits for this round only, not for a round launched after it
        return self.host.tolist()


class RoundRunner:
    """Runs rounds for one (target, drafter, tree, rule): eagerly, or on CUDA by replaying a captured graph
    of ``run_round`` (captured on first use, optionally compiled first; eager again wherever capture fails,
    with the same outputs). In graph mode ``launch`` returns before the round ends, so the host can read
    one round while the GPU runs the next.

    Keep one runner per configuration: its RoundState buffers and its graph are reused across calls.
    """

    def __init__(self, target: Target, drafter: SlotDrafter | None, tree_cfg: TreeConfig, rule: AcceptanceRule,
                 use_graph: bool | None = None, compile: bool = False, attention: str = "sdpa") -> None:
        self.target, self.drafter, self.tree_cfg, self.rule = target, drafter, tree_cfg, rule
        self.attention = attention  # tree-attention backend of this runner's rounds (fsd_eagle.attention)
        dev = target.device
        self.state = RoundState(torch.zeros((), dtype=torch.long, device=dev))
        if use_graph is None:  # sampling draws from a per-call generator: graphs only for greedy rules
            use_graph = dev.type == "cuda" and rule.sampling.greedy
        self.use_graph = use_graph
        self.compile = compile and use_graph
        self.graph: tuple[torch.cuda.CUDAGraph, torch.Tensor] | None = None  # (graph, its output buffer)
        self.captured_for: tuple = ()
        self.host: list[torch.Tensor] = []  # two pinned output buffers, used in turn (two rounds in flight)
        self.turn = 0
        # Prefills by padded length: (ids buffer, length buffer, the prefill on them, its (graph, outputs)
        # or None where capture failed).
        self.prefills: dict[int, tuple] = {}
        self.prefills_for: tuple = ()

    def prompt_slots(self, prompt_len: int) -> int:
        """Cache rows the prefill writes: the padded length in graph mode."""
        return prefill_bucket(prompt_len) if self.use_graph else prompt_len

    def prefill(self, prompt_ids: torch.Tensor, generator: torch.Generator | None):
        """``prefill`` of the prompt ``[L]`` (caches allocated): eagerly, or in graph mode by replaying the
        graph captured for its bucket (the eager HF forward is ~25 ms of kernel launches on the H200).
        Returns (root_token, root) as ``prefill``."""
        n = prompt_ids.shape[0]
        sampling = self.rule.sampling
        if not self.use_graph:
            return prefill(self.target, self.drafter, prompt_ids, torch.tensor(n, device=prompt_ids.device),
                           sampling, generator)
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
            args = (self.target, self.drafter, ids, length, sampling, None)
            fn = functools.partial(prefill, *args)
            state = [self.target.length] + ([self.drafter.length] if self.drafter else [])
            captured = capture(functools.partial(compiled_prefill(), *args), state) if self.compile else None
            if captured is None:  # not compiled, or compilation failed: eager kernels, still captured
                captured = capture(fn, state)
            entry = self.prefills[size] = (ids, length, fn, captured)  # captured None: this bucket runs eagerly
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

    def launch(self, generator: torch.Generator | None) -> PendingRound:
        """Start one round; its result is read with ``.result()``."""
        self._apply_attention()
        if self.use_graph:
            caches = (self.target.cache, getattr(self.drafter, "cache", None), self.state.root_logits)
            if self.graph is None or any(a is not b for a, b in zip(caches, self.captured_for)):
                # (Re)capture: first use, or a cache was reallocated (the graph holds its addresses).
                self.graph = capture(self._round_fn(), self._state_tensors())
                if self.graph is None and self.attention != "sdpa":
                    # e.g. inductor finds no FlexAttention kernel for this model's head size; eager flex
                    # would be a slow reference, so the rounds switch to SDPA, still captured.
                    self.attention = "sdpa"
                    self._apply_attention()
                    self.graph = capture(self._round_fn(), self._state_tensors())
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
        out = run_round(self.target, self.drafter, self.state, self.tree_cfg, self.rule, generator)
        return PendingRound(out.cpu())

    def _apply_attention(self) -> None:
        self.target.use_attention(self.attention)
        if isinstance(self.drafter, ModelDrafter):
            self.drafter.model.use_attention(self.attention)

    def _round_fn(self):
        fn = run_round
        if self.compile:
            fn = compiled_round()
        return lambda: fn(self.target, self.drafter, self.state, self.tree_cfg, self.rule, None)

    def _state_tensors(self) -> list[torch.Tensor]:
        st = self.state
        tensors = [self.target.length, st.root_token]
        if self.drafter is not None:
            tensors += [self.drafter.length, st.root_logits, st.root_state]
        return tensors


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
           tree_cfg: TreeConfig, rule: AcceptanceRule, generator: torch.Generator | None,
           stats: DecodeStats, runner: RoundRunner | None = None) -> Iterator[list[int]]:
    """Yield the new token ids of each round (the caller stops iterating on EOS / stop strings).

    prompt_ids ``[L]`` on the target's device. ``stats`` is filled as rounds complete; at most
    ``max_new_tokens`` ids are yielded in total. ``runner``: a reusable RoundRunner for this configuration
    (default: a fresh eager one). With a graph runner, the next round is launched before this one is read
    unless this one may end the call (so a round is computed in vain only after an EOS or a stop string).
    """
    if max_new_tokens < 1:  # the prefill would already produce one token
        return
    drafting = drafter is not None and tree_cfg.drafts
    drafter = drafter if drafting else None
    if runner is None:
        runner = RoundRunner(target, drafter, tree_cfg, rule, use_graph=False, attention=target.attention)
    start = time.perf_counter()
    granularity = 2048 if target.device.type == "cuda" else 256
    max_len = plan_cache(runner.prompt_slots(prompt_ids.shape[0]), max_new_tokens, tree_cfg, granularity)
    target.allocate(max_len)
    if drafting:
        drafter.allocate(max_len, tree_cfg)
    root_token, root = runner.prefill(prompt_ids, generator)
    runner.start(root_token, root)
    # With a graph runner, the round launched ahead of the one read last (the first one before the prefill
    # is read).
    pending = runner.launch(generator) if runner.use_graph and max_new_tokens > 1 else None
    stats.target_forwards += 1
    produced = 1
    stats.new_tokens += 1
    first = int(root_token)  # waits for the prefill
    stats.elapsed_s = stats.prefill_s = time.perf_counter() - start
    yield [first]
    # A round yields at most ``most`` tokens: a round that may end the call gets no successor launched
    # ahead (computing one in vain costs a whole round; waiting costs only a launch).
    most = min(tree_cfg.depth, tree_cfg.total_tokens - 1) + 1 if drafting else 1
    while produced < max_new_tokens:
        current = pending or runner.launch(generator)
        ahead = runner.use_graph and produced + most < max_new_tokens
        pending = runner.launch(generator) if ahead else None
        host = current.result()  # the round's only host sync
        n_acc, fuzzy_extra, div_count, div_sum = int(host[0]), int(host[1]), int(host[2]), host[3]
        new = [int(t) for t in host[4: 4 + n_acc]][: max_new_tokens - produced]
        produced += len(new)
        stats.target_forwards += 1
        stats.new_tokens += len(new)
        stats.fuzzy_accepted += fuzzy_extra
        stats.divergence_count += div_count
        stats.divergence_sum += div_sum
        stats.accept_lengths.append(n_acc)
        stats.elapsed_s = time.perf_counter() - start
        yield new


def _next_tokens(tree: DraftTree, verdict: Verdict) -> torch.Tensor:
    """``[P]``: the token after each accepted path node (the next accepted draft, then the bonus)."""
    nxt = torch.cat([tree.tokens[verdict.path[1:]], verdict.bonus.reshape(1)])
    return nxt.scatter(0, (verdict.n_accepted - 1).reshape(1), verdict.bonus.reshape(1))

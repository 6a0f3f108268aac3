"""A decoding round for B batch rows: draft tree -> verify forward (acceptance rule) -> commit; and the
prefill that starts a prompt. Plain autoregressive decoding is the same round with no drafter: each tree is
its root alone. Everything here is device code without host syncs; ``fsd_eagle.session`` runs rounds
(eagerly, captured, compiled) and ``fsd_eagle.schedule`` feeds prompts to rows.
"""

from __future__ import annotations

import contextlib
import functools
import os
import time
import traceback
import warnings
from dataclasses import dataclass, field
from pathlib import Path
from typing import Iterator

import torch

from . import compile_cache, precompiled
from .attention import flex_supported
from .config import TreeConfig
from .drafter import DraftRoot, ModelDrafter, SlotDrafter
from .ops import pick
from .precompiled import Precompiled, describe
from .rng import RandomStream
from .sampling import RuleForm, RuleValues, choose
from .target import Target, attention_flag_kept
from .tree import DraftTree, draft_tree, root_tree
from .verify import AcceptanceRule, Verdict, verify_tree


@dataclass
class DecodeStats:
    """Per-prompt statistics. tau = new tokens / target forwards (the prefill counts as one forward; in a
    batch, every round in which the prompt's row decodes counts once)."""

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
    """What one round hands the next for B batch rows, as device tensors updated in place (a captured graph
    reads them): the root tokens ``[B]`` (the target's last choices), the drafter's root logits ``[B, V_d]``
    and states ``[B, s]``, each row's rule numbers and random stream, and ``active`` ``[B]`` (rows that are
    decoding a prompt: only they grow their caches)."""

    root_token: torch.Tensor
    values: RuleValues
    rng: RandomStream
    active: torch.Tensor
    root_logits: torch.Tensor | None = None
    root_state: torch.Tensor | None = None

    @classmethod
    def create(cls, device: torch.device, batch: int = 1) -> "RoundState":
        return cls(torch.zeros(batch, dtype=torch.long, device=device), RuleValues.create(device, batch),
                   RandomStream.create(device, batch=batch), torch.zeros(batch, dtype=torch.bool, device=device))

    def batch_tensors(self) -> list[tuple[torch.Tensor, int]]:
        """Every tensor with its batch dimension (0; see ``mark_batch_dynamic``)."""
        roots = [t for t in (self.root_logits, self.root_state) if t is not None]
        own = [(t, 0) for t in [self.root_token, self.active] + roots]
        return own + self.values.batch_tensors() + self.rng.batch_tensors()

    def load_root(self, rows: torch.Tensor | None, root_token: torch.Tensor, root: DraftRoot | None) -> None:
        """Rows ``rows`` (an index tensor; None: every row) take a prefill's first tokens and draft roots."""
        if root is not None and (self.root_logits is None or self.root_logits.shape[1:] != root.logits.shape[1:]):
            b = self.root_token.shape[0]
            self.root_logits = root.logits.new_zeros((b,) + root.logits.shape[1:])
            self.root_state = root.state.new_zeros((b,) + root.state.shape[1:])
        pairs = [(self.root_token, root_token)]
        if root is not None:
            pairs += [(self.root_logits, root.logits), (self.root_state, root.state)]
        for mine, theirs in pairs:
            if rows is None:
                mine.copy_(theirs)
            else:
                mine.index_copy_(0, rows, theirs)


def prefill(target: Target, drafter: SlotDrafter | None, ids: torch.Tensor, n: torch.Tensor, form: RuleForm,
            values: RuleValues, rng: RandomStream) -> tuple[torch.Tensor, DraftRoot | None]:
    """Prompts -> both KV caches (emptied by ``allocate``). ids ``[B, Lb]``: row b's prompt in its first
    n[b] entries (n ``[B]``), padding after it, so that one captured graph serves every prompt of a bucket
    (the padding's cache rows lie past the prefix: masked, then overwritten). Returns the target's first
    tokens ``[B]`` (sampled with ``rng``'s step 0, which then advances) and the drafter's roots (None
    without one)."""
    features = target.prefill(ids)
    target.length.copy_(n)
    root_token = choose(target.logits(pick(features, n - 1)), form, values, rng)
    if not form.greedy:
        rng.advance()
    if drafter is None:
        return root_token, None
    tokens = torch.cat([ids, ids[:, :1]], 1).scatter(1, n.unsqueeze(1), root_token.unsqueeze(1))
    return root_token, drafter.prefill(tokens, features, n)


# Prompts up to this many tokens are padded to a power of two: their prefill's time is mostly kernel launches.
PREFILL_POW2_UP_TO = 512


def prefill_bucket(prompt_len: int) -> int:
    """Padded prompt length of a captured prefill (a graph per padded length and number of rows): up to
    PREFILL_POW2_UP_TO tokens, the next power of two, at least 64 (few graphs; a prefill of a few hundred
    tokens costs kernel launches, not arithmetic, so its padding costs little); above, the next multiple of
    an eighth of the power of two below (of 64 tokens up to 1024, of 128 up to 2048, ...), where padding
    costs arithmetic: at most 1/8 of the prompt, in 8 buckets per doubling of the length."""
    if prompt_len <= PREFILL_POW2_UP_TO:
        return max(64, 1 << (prompt_len - 1).bit_length())
    step = 1 << ((prompt_len - 1).bit_length() - 4)
    return -(-prompt_len // step) * step


@dataclass
class RoundResult:
    """One round of one batch row as the host reads it: ``n_accepted`` tokens (root included: the tokens
    this round adds), draft tokens accepted beyond the exact rule (``fuzzy_extra``), the sum and count of
    the divergences at the path's decision nodes, and ``tokens``, the round's new tokens (``n_accepted``)."""

    n_accepted: int
    fuzzy_extra: int
    div_count: int
    div_sum: float
    tokens: list[int]

    # The packed device form of a row (see ``pack_round``): these four, then the P = depth + 1 next tokens.
    FIELDS = ("n_accepted", "fuzzy_extra", "div_count", "div_sum")

    @classmethod
    def unpack(cls, packed: list[float]) -> "RoundResult":
        meta = dict(zip(cls.FIELDS, packed))
        n = int(meta["n_accepted"])
        tokens = [int(t) for t in packed[len(cls.FIELDS): len(cls.FIELDS) + n]]
        return cls(n, int(meta["fuzzy_extra"]), int(meta["div_count"]), meta["div_sum"], tokens)


def pack_round(verdict: Verdict, next_tokens: torch.Tensor) -> torch.Tensor:
    """``[B, 4 + P]`` float64 (token ids are exact in float64): per row RoundResult.FIELDS, then the next
    tokens. One tensor, so that the host reads a round with one copy."""
    meta = torch.stack([verdict.n_accepted, verdict.fuzzy_extra, verdict.div_count], 1).double()
    return torch.cat([meta, verdict.div_sum.double().unsqueeze(1), next_tokens.double()], 1)


def run_round(target: Target, drafter: SlotDrafter | None, state: RoundState, tree_cfg: TreeConfig,
              form: RuleForm) -> torch.Tensor:
    """One round for every batch row: draft tree -> verify forward -> acceptance rule -> commit to both KV
    caches (and, when sampling, advance the random streams). Returns the packed round (``pack_round``; read
    with RoundResult.unpack)."""
    if drafter is not None:
        sampled = dict(rng=state.rng, temperature=state.values.temperature) if form.sampled_children else {}
        tree = draft_tree(drafter, state.root_token, state.root_logits, state.root_state, tree_cfg,
                          with_q=form.fuzzy, **sampled)
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
    """Commit each row's accepted path to both KV caches and hand the next round its roots (``state``, in
    place); rows that are not active keep their lengths. features: the target's ``[B, n, h]`` over the
    trees. Returns the P next tokens of each row ``[B, P]`` (see ``_next_tokens``)."""
    grow = verdict.n_accepted * state.active
    target.commit(verdict.path, grow)
    next_tokens = _next_tokens(tree, verdict)
    if drafter is not None:
        path_features = features.gather(1, verdict.path.unsqueeze(2).expand(-1, -1, features.shape[2]))
        root = drafter.commit(next_tokens, path_features, verdict.n_accepted, grow=grow)
        state.root_logits.copy_(root.logits)
        state.root_state.copy_(root.state)
    state.root_token.copy_(verdict.bonus)
    return next_tokens


# Graphs dynamo may keep per compiled function: one per tree/rule form and cache size (rounds: one-row and
# batched ones apart), per form and prompt bucket (prefills). Past its default limit of 8, dynamo silently runs
# the function eagerly, which the graph would capture as slow eager kernels (seen with 5 trees in one process).
RECOMPILE_LIMIT = 64


#: Set to 1 to compile with inductor's freezing (``_compile``); opt-in (the fused copies take memory).
FREEZING_ENV = "FSD_EAGLE_INDUCTOR_FREEZING"


def freezing() -> bool:
    """Whether compiled rounds and prefills use inductor's freezing (``FSD_EAGLE_INDUCTOR_FREEZING=1``):
    the weights become constants of the compiled code, so that matmuls of one input (q/k/v, gate/up) are
    fused into one (7 of a Llama layer's matmuls become 4); the weights must not change after the first
    compilation (an Engine's never do), and the fused copies take memory beside the weights. Off in a
    tensor-parallel process (more than one rank): freezing would make the process group that the sharded
    layers sum over a constant of the compiled code, which inductor cannot do."""
    return os.environ.get(FREEZING_ENV, "").strip() == "1" and not _tensor_parallel()


def inductor_settings(freeze: bool, batched: bool) -> dict:
    """Inductor settings patched around a compilation: ``freezing`` as asked and, for ``batched`` rounds (a
    symbolic batch size), no coalescing analysis of Triton tilings (``triton.coalesce_tiling_analysis``,
    where this torch has it). Inductor notes that the analysis does not yet handle symbolic shapes; on a
    symbolic batch it failed an internal size assertion (``tiling_utils``) while compiling the batched
    rounds of the FSD rule on an H200 (torch 2.11), which then ran as uncompiled graph rounds at about half
    the speed (6.5 ms per round). Turning it off changes the kernels' tiling, not what they compute."""
    settings: dict = {"freezing": freeze}
    if batched and hasattr(torch._inductor.config.triton, "coalesce_tiling_analysis"):
        settings["triton.coalesce_tiling_analysis"] = False
    return settings


def _compile(fn, dynamic: bool = False, batched: bool = False):
    """``fn`` compiled by inductor. Static shapes, or with ``dynamic``: symbolic exactly for the dimensions
    that its caller marks (``mark_batch_dynamic``; a prefill's padded prompt length), from the first
    compilation on. Dynamo's automatic dynamic shapes (a dimension turns symbolic once it differs from an
    earlier compilation of the same function) is off while tracing: it would make a compilation depend on
    what the process compiled before (a batched round after AR rounds gets other graphs than alone), so
    kernels compiled by one process (a warm-up, a ``FSD_EAGLE_COMPILE_CACHE`` file) would not serve another
    that runs the same plan; a size that no mark covers compiles again, static. Duck sizing (one symbol for
    dimensions that happen to be equal, such as a batch of 8 and a top-k of 8) is turned off while tracing:
    it would tie the batch to the tree and compile again for the next size. Every call keeps transformers'
    attention flag as it was (``target.attention_flag_kept``). With ``freezing()``, compiled
    with inductor's freezing. Kernels of ``FSD_EAGLE_COMPILE_CACHE`` (fsd_eagle.compile_cache) are loaded
    first. ``batched``: a batched round (implies ``dynamic``); inductor's
    settings while compiling: ``inductor_settings``."""
    dynamic = dynamic or batched
    compile_cache.restore()
    torch._dynamo.config.recompile_limit = max(torch._dynamo.config.recompile_limit, RECOMPILE_LIMIT)
    compiled = torch.compile(fn, dynamic=None if dynamic else False)
    freeze = freezing()
    if not freeze and not _tensor_parallel():  # kept whole on disk where a folder is set (fsd_eagle.precompiled)
        compiled = Precompiled(fn, fn.__name__ + ("_batched" if batched else ""), None if dynamic else False,
                               compiled, variant_of)
    patched = dynamic or freeze  # static rounds compile with torch's defaults

    @functools.wraps(fn)
    def call(*args, **kwargs):
        # Called for warm-ups and captures (graphs replay the rounds), so the patches cost nothing per round.
        with attention_flag_kept(), contextlib.ExitStack() as settings:
            if patched:
                settings.enter_context(torch.fx.experimental._config.patch(use_duck_shape=not dynamic))
                settings.enter_context(torch._dynamo.config.patch(automatic_dynamic_shapes=False))
                settings.enter_context(torch._inductor.config.patch(inductor_settings(freeze, batched)))
                settings.enter_context(torch.no_grad())
            if not isinstance(compiled, Precompiled):
                precompiled.refuse(fn.__name__, "not saved: compiled with freezing or in a tensor-parallel process")
            return compiled(*args, **kwargs)

    return call


def _tensor_parallel() -> bool:
    """Whether this process is one rank of several (tensor parallelism)."""
    dist = torch.distributed
    return dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1


def variant_of(*args) -> str:
    """The folder name of a compiled round's or prefill's saved specializations (fsd_eagle.precompiled):
    what its arguments are beyond what the saved guards check (tensor shapes, attribute values): the
    settings objects (tree, rule form; dataclasses, by value), the class of every other object (Target,
    drafter, round state) with its tree attention where it has one, and each tensor's dtype and device."""
    parts = []
    for arg in args:
        if isinstance(arg, torch.Tensor):
            parts.append((arg.dtype, arg.device.type))
        elif arg is None or isinstance(arg, (TreeConfig, RuleForm)):
            parts.append(arg)
        else:
            parts.append((type(arg).__qualname__, getattr(arg, "attention", None)))
    return describe(*parts)


def mark_batch_dynamic(*holders) -> None:
    """Mark the batch dimension of every tensor that ``holders`` (objects with ``batch_tensors()``, such as
    Target, SlotDrafter and RoundState; None is skipped) hold as dynamic, so that the next compilation that
    reads them keeps the batch size symbolic: it then serves every batch size >= 2 (dynamo specializes sizes
    0 and 1). ``maybe_mark_dynamic``: where code fixes a size the dimension quietly stays static (another
    size then compiles again) instead of failing. A mark belongs to the tensor object: tensors allocated
    later need marking again (marking twice does nothing)."""
    for holder in holders:
        if holder is None:
            continue
        for tensor, dim in holder.batch_tensors():
            torch._dynamo.maybe_mark_dynamic(tensor, dim)


@functools.cache
def compiled_round(batched: bool = False):
    """``run_round`` compiled by inductor: fuses a round's many small kernels (norms, rotary, masks, tree
    bookkeeping, the sampling rule's random numbers; on the H200 a compiled round took 3.6 ms against 6.5 ms)
    before graph capture. dynamo compiles per tree, rule form and cache shape, not per rule value.

    One-row rounds compile with static shapes (the fastest rounds). ``batched`` rounds (B > 1) mark the
    batch dimension of the target's, drafter's and round state's tensors dynamic before every call
    (``mark_batch_dynamic``; caches may have been reallocated since the last call), so that their first
    compilation serves every batch size: a symbolic-batch round replayed within 4% of a static one on an
    H200, and later batch sizes start in about a second instead of 50-90 s
    (eval/results/archive/gpu_batch_round_cost.json)."""
    compiled = _compile(run_round, batched=batched)
    if not batched:
        return compiled

    @functools.wraps(run_round)
    def call(target: Target, drafter: SlotDrafter | None, state: RoundState, tree_cfg: TreeConfig,
             form: RuleForm) -> torch.Tensor:
        mark_batch_dynamic(target, drafter, state)
        return compiled(target, drafter, state, tree_cfg, form)

    return call


@functools.cache
def compiled_prefill():
    """``prefill`` compiled by inductor, with the padded prompt length symbolic (the Session marks it: one
    compilation serves every length bucket; a CUDA graph is still captured per bucket). A 64-token
    prefill of SmolLM2-135M replayed in 6.6-6.9 ms on an H100 when captured from eager kernels, in 4.7-4.9 ms
    compiled (static shapes)."""
    return _compile(prefill, dynamic=True)


def round_attention(compiled: bool, config, preferred: str | None = None, rows: int = 1) -> str:
    """The tree attention of a session's rounds: FlexAttention only where the round is compiled (eager
    FlexAttention is a slow reference), and only for models it fits; else SDPA. ``preferred``: a user's
    choice ("sdpa" or "flex"; None: flex for one-row rounds, measured fastest for compiled GPU rounds, and
    SDPA for ``rows`` > 1, the form whose batched throughput the batch presets were tuned with; both decode
    every row as alone on a GPU, FlexAttention with per-row block lists per head, ``attention.block_mask``)."""
    if compiled and flex_supported(config) and (preferred == "flex" or (preferred is None and rows == 1)):
        return "flex"
    return "sdpa"


def capture_first(candidates: list, state: list[torch.Tensor], pool=None):
    """(graph, outputs) of the first of ``candidates`` (functions without arguments) that captures; None if
    none does (see ``capture``)."""
    for fn in candidates:
        captured = capture(fn, state, pool)
        if captured is not None:
            return captured
    return None


def capture(fn, state: list[torch.Tensor], pool=None) -> tuple[torch.cuda.CUDAGraph, object] | None:
    """Capture ``fn`` (a round, or a prefill) in a CUDA graph. Warm-up runs (which also compile a compiled
    ``fn``) go on a side stream and ``state`` is restored after each, so capturing changes nothing (a round
    only writes cache rows past the committed prefix). ``pool`` (another graph's ``pool()``): the memory
    pool the graph shares with the graphs captured into it (None: a pool of its own); sharing is safe only
    for graphs that replay one at a time, each one's outputs used before another replays. Returns
    (graph, fn's outputs), or None (eager fallback) if ``fn`` cannot be compiled or captured."""
    saved = [t.clone() for t in state]
    caller = torch.cuda.current_stream()
    stream = torch.cuda.Stream()
    stream.wait_stream(caller)
    try:
        with torch.cuda.stream(stream):
            for _ in range(2):
                fn()
                for t, v in zip(state, saved):
                    t.copy_(v)
            graph, out = record(fn, pool)
        caller.wait_stream(stream)
    except RuntimeError as e:  # an op that syncs or is not capturable here; inductor errors are RuntimeErrors
        stream.synchronize()
        for t, v in zip(state, saved):
            t.copy_(v)
        caller.wait_stream(stream)
        warnings.warn(f"CUDA graph capture failed: {failure(e)}")
        return None
    return graph, out


def record(fn, pool=None) -> tuple[torch.cuda.CUDAGraph, object]:
    """Capture one call of ``fn`` on the current (side) stream in thread-local mode: other threads may go on
    using the GPU meanwhile (a server replays its graphs on one thread while another captures compiled
    rounds); unlike ``torch.cuda.graph`` nothing syncs the whole device or empties the allocator's cache."""
    graph = torch.cuda.CUDAGraph()
    graph.capture_begin(pool=pool, capture_error_mode="thread_local")
    try:
        out = fn()
    except BaseException:
        try:
            graph.capture_end()
        except RuntimeError:  # the capture was already invalidated by what ``fn`` raised on
            pass
        raise
    graph.capture_end()
    return graph, out


def failure(e: BaseException) -> str:
    """One line on why ``e`` was raised: its first line and, from the innermost exception it wraps (inductor
    wraps its own errors, often an assertion without a message), that one's type and the file and line
    where it was raised; when that one stands for an error in inductor's compile workers (their
    ``SubprocException`` carries the worker's traceback as ``details``), also the worker's own error."""
    inner = e
    while (wrapped := inner.__cause__ or getattr(inner, "inner_exception", None)) is not None:
        inner = wrapped
    where = traceback.extract_tb(inner.__traceback__)
    place = f"{type(inner).__name__} at {Path(where[-1].filename).name}:{where[-1].lineno}" if where else ""
    details = getattr(inner, "details", None)
    if isinstance(details, str) and details.strip():
        place += ("; " if place else "") + "in the worker: " + worker_error(details)
    return (str(e).splitlines() or [type(e).__name__])[0] + (f" ({place})" if place else "")


def worker_error(details: str, limit: int = 400) -> str:
    """The error of a formatted traceback ``details``, on one line of at most ``limit`` characters: the line
    that names the last exception (the first unindented line after the last "Traceback"), and the last line
    when the message runs over several (Triton's compilation errors end with the reason)."""
    lines = details.rstrip().splitlines()
    starts = [i for i, line in enumerate(lines) if line.startswith("Traceback")]
    after = lines[starts[-1] + 1:] if starts else lines
    named = next((line for line in after if line.strip() and not line[0].isspace()), after[-1] if after else "")
    last = lines[-1].strip() if lines else ""
    text = named.strip() + (f" ... {last}" if last and last != named.strip() else "")
    return text if len(text) <= limit else text[: limit - 3] + "..."


def _next_tokens(tree: DraftTree, verdict: Verdict) -> torch.Tensor:
    """``[B, P]``: the token after each accepted path node (the next accepted draft, then the bonus)."""
    bonus = verdict.bonus.unsqueeze(1)
    nxt = torch.cat([tree.tokens.gather(1, verdict.path[:, 1:]), bonus], 1)
    return nxt.scatter(1, (verdict.n_accepted - 1).unsqueeze(1), bonus)

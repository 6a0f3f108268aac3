"""Engine tests on tiny random models (fp32, CPU): greedy exactness against a plain recompute-everything
loop, draft-tree and verifier invariants, KV compaction, draft-head loading, and lossless sampling
(chi-square tests that are also shown to fail when the acceptance rule is broken on purpose)."""

from __future__ import annotations

import copy
import dataclasses
import functools
import json
import math
from collections import Counter
from itertools import product

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import fsd_eagle.verify as verify_module
from conftest import cpu_kernels, gpu_session_on_the_cpu, has_cpu_compiler, tiny_model
from fsd_eagle.attention import BACKENDS, FLEX_BLOCK, block_mask
from fsd_eagle.cache import SlotMask
from fsd_eagle.config import SamplingConfig, TreeConfig
from fsd_eagle.decode import (DecodeStats, RoundState, compiled_prefill, compiled_round, plan_cache, prefill,
                              prefill_bucket, run_round)
from fsd_eagle.drafter import EagleDrafter, ModelDrafter
from fsd_eagle.engine import Engine
from fsd_eagle.errors import ConfigError
from fsd_eagle.head import EagleHead, HeadConfig
from fsd_eagle.models import load_head, save_head
from fsd_eagle.target import Target
from fsd_eagle.tree import draft_tree
from fsd_eagle.rng import DRAW_ACCEPT, RandomStream
from fsd_eagle.sampling import RuleValues
from fsd_eagle.schedule import decode
from fsd_eagle.session import PendingRound, Plan, Session
import fsd_eagle.session as session_module
from fsd_eagle.verify import AcceptanceRule, Verdict

from conftest import CHI_ROWS, ancestors, chi_square_pvalue, decode_all, make_session, reference_probs, sample_pairs_on, verify

CPU = torch.device("cpu")
GREEDY = AcceptanceRule()
TREES = {
    "default": TreeConfig(),  # 60 nodes, depth 6, top_k 10
    "chain": TreeConfig(total_tokens=6, depth=5, top_k=1),
    "overfull": TreeConfig(total_tokens=500, depth=3, top_k=3),  # only 1 + 3 + 9 + 9 = 22 nodes exist
    "depth1": TreeConfig(total_tokens=8, depth=1, top_k=7),
    "tiny": TreeConfig(total_tokens=2, depth=6, top_k=1),  # fewer nodes than the depth allows
}


# ----------------------------------------------------------------------------------------- helpers


@torch.no_grad()
def reference_greedy(model, prompt: torch.Tensor, n: int) -> list[int]:
    """Plain greedy decoding that recomputes the whole sequence every step (no cache, no engine code)."""
    ids = prompt.tolist()
    for _ in range(n):
        ids.append(int(model(torch.tensor([ids])).logits[:, -1].argmax()))
    return ids[len(prompt):]


def run_decode(engine, prompt, n, tree, rule=GREEDY, seed=0, attention="sdpa"):
    """Decode on a fresh session of ``tree`` over ``engine`` (eager rounds with ``attention``)."""
    session = make_session(tree=tree, rule=rule, engine=engine)
    session.attention = attention  # eager rounds with FlexAttention: the reference form of its block masks
    return decode_all(session, prompt, n, rule, seed)


def noisy_copy(model, scale: float, seed: int = 1):
    """A copy of ``model`` with Gaussian noise (``scale`` x each matrix's std) on its weight matrices."""
    noisy = copy.deepcopy(model)
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for param in noisy.parameters():
            if param.dim() > 1:
                param.add_(scale * param.std() * torch.randn(param.shape, generator=gen).to(param.device))
    return noisy


def random_prompt(seed: int, vocab: int, lo: int = 5, hi: int = 12) -> torch.Tensor:
    gen = torch.Generator().manual_seed(1000 + seed)
    n = int(torch.randint(lo, hi + 1, (1,), generator=gen))
    return torch.randint(0, vocab, (n,), generator=gen)


@functools.lru_cache(maxsize=None)
def cached_model(arch: str):
    return tiny_model(arch)


@pytest.fixture(scope="module", params=["llama", "qwen2", "qwen3", "gemma3"])
def arch_model(request):
    return request.param, cached_model(request.param)


# ------------------------------------------------------------------- 1. exactness (greedy, fp32)


@torch.no_grad()
@pytest.mark.filterwarnings("ignore:.*flex_attention.*")
@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("arch", ["llama", "qwen2", "qwen3", "gemma3", "mistral"])
def test_target_logits_match_the_models_own_forward(arch, backend):
    """Target.prefill / forward_tree (tree masks, positions, slot cache, sliding window, soft-capping) give
    the logits of the model's default forward over prefix + root path, also after a commit, with every
    tree-attention backend; for two batch rows at once, whose prefixes grow apart (each row is checked
    against its own sequence)."""
    model = copy.deepcopy(cached_model(arch))  # use_attention switches the model's attention function
    target = Target(model)
    target.use_attention(backend)
    target.allocate(64, batch=2)
    gen = torch.Generator().manual_seed(3)
    seqs = torch.randint(0, 128, (2, 10), generator=gen)  # longer than the sliding windows (6 tokens)
    features = target.prefill(seqs)
    torch.testing.assert_close(target.logits(features), model(seqs).logits, atol=1e-4, rtol=1e-4)
    seqs = list(seqs)
    # A branching tree: 0 -> {1, 2}, 1 -> {3, 4}, 2 -> {5}, 3 -> {6}, 6 -> {7}.
    parents = torch.tensor([0, 0, 0, 1, 1, 2, 3, 6])
    depths = torch.tensor([0, 1, 1, 2, 2, 2, 3, 4])
    n = parents.shape[0]
    anc = ancestors(parents)
    for _round in range(2):
        tokens = torch.randint(0, 128, (2, n), generator=gen)
        logits = target.logits(target.forward_tree(tokens, depths.expand(2, n), anc.expand(2, n, n)))
        for b in range(2):
            for i in range(n):
                path = anc[i].nonzero().flatten()
                ref = model(torch.cat([seqs[b], tokens[b, path]])[None]).logits[0, -1]
                torch.testing.assert_close(logits[b, i], ref, atol=1e-4, rtol=1e-4)
        # Row 0 commits the branch 0-1-3-6-7 (not a contiguous block of slots), row 1 the branch 0-2-5
        # (padded by repeating its last node); grow the reference sequences.
        paths = torch.tensor([[0, 1, 3, 6, 7], [0, 2, 5, 5, 5]])
        accepted = torch.tensor([5, 3])
        target.commit(paths, accepted)
        for b in range(2):
            seqs[b] = torch.cat([seqs[b], tokens[b, paths[b, : accepted[b]]]])
        assert target.length.tolist() == [seqs[0].shape[0], seqs[1].shape[0]]


@torch.no_grad()
@pytest.mark.parametrize("arch", ["gemma3", "mistral"])
def test_sliding_window_matters_at_these_lengths(arch):
    """Guards the exactness tests: with these lengths the window of 6 changes the logits."""
    model = cached_model(arch)
    wide = tiny_model(arch, sliding_window=1000)
    wide.load_state_dict(model.state_dict())
    ids = random_prompt(0, 128, 12, 12)[None]
    assert (model(ids).logits[0, -1] - wide(ids).logits[0, -1]).abs().max() > 1e-3
    assert (model(ids[:, :6]).logits - wide(ids[:, :6]).logits).abs().max() < 1e-5


def _engine(kind: str, model) -> Engine:
    """``model`` with a drafter of ``kind`` (None: no drafter)."""
    if kind == "eagle":  # a random head: its drafts are rarely accepted
        with torch.random.fork_rng():
            torch.manual_seed(5)
            return Engine(model, None, head=EagleHead(HeadConfig.for_target(model.config)).eval())
    if kind == "noisy":
        return Engine(model, None, draft_model=noisy_copy(model, 0.1))
    if kind == "self":
        return Engine(model, None, draft_model=model)  # a session's own Target (own cache) over the same weights
    if kind is None:
        return Engine(model, None)
    raise ValueError(kind)


@pytest.mark.parametrize("kind", ["eagle", "noisy", "self"])
def test_greedy_decoding_is_exact(arch_model, kind):
    check_greedy_exact(*arch_model, kind, seeds=(0, 1))


@pytest.mark.parametrize("kind", ["eagle", "noisy"])
def test_greedy_decoding_is_exact_with_a_window_on_every_layer(kind):
    check_greedy_exact("mistral", cached_model("mistral"), kind, seeds=(0,))


def test_greedy_decoding_is_exact_through_the_transposed_cpu_projection(mm_calls):
    """A target whose lm_head is large enough for ``ops.project``'s ``weight @ x.T`` on the CPU (a few rows, a
    weight of LARGE_WEIGHT elements): every tree and AR stay token-identical to the reference loop (which
    uses transformers' own lm_head), and the transposed path ran."""
    from fsd_eagle import ops

    model = tiny_model("llama", vocab_size=ops.LARGE_WEIGHT // 64)
    for kind in ("eagle", "noisy"):
        check_greedy_exact("llama", model, kind, seeds=(0,))
    assert (ops.LARGE_WEIGHT // 64, 64) in mm_calls


@pytest.mark.filterwarnings("ignore:.*flex_attention.*")
@pytest.mark.parametrize("arch", ["llama", "gemma3"])
def test_greedy_decoding_is_exact_with_flex_attention(arch):
    """FlexAttention block masks (eager reference form; the compiled form is checked below)."""
    model = copy.deepcopy(cached_model(arch))
    backend = "flex"
    for kind in ("eagle", "noisy"):
        check_greedy_exact(arch, model, kind, seeds=(0,), backend=backend)


@pytest.mark.parametrize("heads,kv_heads,n", [(9, 3, 1), (9, 3, 64), (4, 2, 200), (9, 3, 171), (4, 4, 8)])
def test_packed_sdpa_masks_give_the_repeated_keys_result(heads, kv_heads, n):
    """Grouped-query SDPA with a packed mask (each key/value head attends for its query heads at once, no
    key/value copies) equals SDPA over keys and values repeated per query head, in float32, for batch rows
    with their own prefixes; masks of more than PACK_ROWS rows (and models without grouped heads) are not
    packed. The target's attention function takes packed masks too."""
    from fsd_eagle.attention import PACK_ROWS, attend, packed, prepare_mask, tree_attention

    gen = torch.Generator().manual_seed(n)
    b, slots, d = 3, 512, 16
    q = torch.randn(b, heads, n, d, generator=gen)
    k, v = torch.randn(b, kv_heads, slots, d, generator=gen), torch.randn(b, kv_heads, slots, d, generator=gen)
    anc = (torch.rand(b, n, n, generator=gen) < 0.5).tril() | torch.eye(n, dtype=torch.bool)
    mask = SlotMask(torch.tensor([0, 37, 300]), anc, slots)
    plain = prepare_mask(mask, "sdpa", torch.float32)
    mine = prepare_mask(mask, "sdpa", torch.float32, heads, kv_heads)
    groups = heads // kv_heads
    assert packed(mine, q, k) == (groups > 1 and groups * n <= PACK_ROWS)
    assert mine.shape == (b, 1, (groups if packed(mine, q, k) else 1) * n, slots)
    want = torch.nn.functional.scaled_dot_product_attention(
        q, k.repeat_interleave(groups, 1), v.repeat_interleave(groups, 1), attn_mask=plain)
    torch.testing.assert_close(attend(q, k, v, mine), want, atol=2e-6, rtol=0)
    torch.testing.assert_close(attend(q, k, v, plain), want, atol=2e-6, rtol=0)
    if packed(mine, q, k):  # (others go to transformers' own SDPA function, which needs the model's module)
        out, _ = tree_attention(None, q, k, v, mine, scaling=d ** -0.5)
        torch.testing.assert_close(out, want.transpose(1, 2), atol=2e-6, rtol=0)


def test_packed_sdpa_takes_outputs_in_any_memory_layout(monkeypatch):
    """CUDA's SDPA kernels return ``[B, H, n, d]`` laid out as ``[B, n, H, d]``; for a packed call that
    layout cannot be split back into query heads by a view. ``attend`` gives the same values for an SDPA
    that returns its output so laid out."""
    import fsd_eagle.attention as attention

    gen = torch.Generator().manual_seed(0)
    b, heads, kv_heads, n, slots, d = 2, 9, 3, 4, 64, 8
    q = torch.randn(b, heads, n, d, generator=gen)
    k, v = torch.randn(b, kv_heads, slots, d, generator=gen), torch.randn(b, kv_heads, slots, d, generator=gen)
    mask = attention.prepare_mask(SlotMask(torch.tensor([3, 20]), torch.eye(n, dtype=torch.bool).expand(b, n, n),
                                           slots), "sdpa", torch.float32, heads, kv_heads)
    assert attention.packed(mask, q, k)
    want = attention.attend(q, k, v, mask)
    sdpa = torch.nn.functional.scaled_dot_product_attention

    def rows_major(*args, **kwargs):
        out = sdpa(*args, **kwargs)
        return out.transpose(1, 2).contiguous().transpose(1, 2)

    monkeypatch.setattr(attention.F, "scaled_dot_product_attention", rows_major)
    torch.testing.assert_close(attention.attend(q, k, v, mask), want, atol=0, rtol=0)


@settings(max_examples=60, deadline=None)
@given(n=st.integers(1, 140), m_extra=st.integers(0, 30), prefix=st.integers(0, 400), window=st.sampled_from([None, 5, 200]),
       seed=st.integers(0, 10_000), shared=st.booleans())
def test_slot_mask_and_its_flex_blocks(n, m_extra, prefix, window, seed, shared):
    """SlotMask.dense is the mask spelled out (committed slots, then the new slots by anc, then a window on
    positions), and the FlexAttention block lists cover it: a "full" block is seen whole by every row, a
    skipped block by none. Two batch rows with other prefixes, trees and positions, each checked alone,
    against its own lists (written out for each of 3 query heads, all alike) or against the one pair of
    lists both share."""
    gen = torch.Generator().manual_seed(seed)
    m = n + m_extra if window is None else n  # a windowed mask's new slots are its own rows
    prefixes = [prefix, int(torch.randint(0, prefix + 1, (1,), generator=gen))]
    anc = torch.rand(2, n, m, generator=gen) < 0.5
    slots = -(-(prefix + m + 1) // FLEX_BLOCK) * FLEX_BLOCK + FLEX_BLOCK * int(seed % 2)
    mask = SlotMask(torch.tensor(prefixes), anc, slots)
    positions = torch.tensor(prefixes).unsqueeze(1) + torch.randint(0, m + 1, (2, n), generator=gen)
    if window is not None:
        mask = mask.windowed(positions, window)
    dense = mask.dense()
    assert dense.shape == (2, n, slots)
    block = block_mask(mask, shared, heads=3)
    lists = ((block.kv_num_blocks, block.kv_indices), (block.full_kv_num_blocks, block.full_kv_indices))
    for count, index in lists:
        assert index.shape[:2] == count.shape[:2] == ((1, 1) if shared else (2, 3))
        assert (count == count[:, :1]).all() and (index == index[:, :1]).all()  # every head the same lists
    one = block_mask(SlotMask(mask.prefix[:1], mask.anc[:1], mask.max_len), shared, heads=3)
    assert one.kv_indices.shape[:2] == (1, 1)  # one row: lists broadcast over the heads
    for b, pre in enumerate(prefixes):
        ref = torch.zeros(n, slots, dtype=torch.bool)
        ref[:, :pre] = True
        ref[:, pre: pre + m] = anc[b]
        if window is not None:
            key_pos = torch.arange(slots)
            key_pos[pre: pre + m] = positions[b]
            ref &= positions[b].unsqueeze(1) - key_pos.unsqueeze(0) < window
        assert torch.equal(dense[b], ref)
        for q_block in range(-(-n // FLEX_BLOCK)):
            rows = ref[q_block * FLEX_BLOCK: (q_block + 1) * FLEX_BLOCK].view(-1, slots // FLEX_BLOCK, FLEX_BLOCK)
            listed = torch.zeros(slots // FLEX_BLOCK, dtype=torch.bool)
            for full, (count, index) in enumerate(lists):
                r = 0 if shared else b
                chosen = index[r, 0, q_block, : int(count[r, 0, q_block])].long()
                assert not listed[chosen].any()  # a block is either full or partial
                listed[chosen] = True
                assert not full or rows[:, chosen].all()
            assert not rows[:, ~listed].any()


@pytest.mark.skipif(not torch.cuda.is_available(), reason="the Triton top-k runs on CUDA only")
@pytest.mark.parametrize("k", [1, 8, 10, 32, 64])
@pytest.mark.parametrize("shape", [(8, 49152), (1, 49152), (8, 16384), (1, 64), (3, 5000), (2, 262144), (2, 70)])
def test_triton_topk_equals_torch_topk(shape, k):
    """fsd_eagle.kernels.topk on CUDA: torch.topk's values and indices, in descending order; among equal
    values the lower index first, -inf entries ranked too."""
    from fsd_eagle.kernels import topk

    x = torch.randn(*shape, device="cuda", generator=torch.Generator("cuda").manual_seed(k))
    vals, idx = topk(x, k)
    ref = x.topk(k)
    assert torch.equal(vals, ref.values) and torch.equal(idx, ref.indices)
    if shape[1] >= k + 40:  # more equal maxima than k
        x[:, 10:10 + k + 30] = 9.0
        vals, idx = topk(x, k)
        assert (vals == 9).all() and torch.equal(idx, torch.arange(10, 10 + k, device="cuda").expand(shape[0], k))
    x[:, :k - 1] = torch.arange(k - 1, 0, -1, device="cuda")  # descending, then -inf: the k-th is the first -inf
    x[:, k - 1:] = float("-inf")
    vals, idx = topk(x, k)
    assert torch.equal(idx, torch.arange(k, device="cuda").expand(shape[0], k)) and vals[:, -1].eq(float("-inf")).all()


@pytest.mark.skipif(not torch.cuda.is_available(), reason="the Triton pool draw runs on CUDA only")
@pytest.mark.parametrize("compiled", [False, True])
@pytest.mark.parametrize("batch,rows,pool,k", [(1, 1, 16, 8), (1, 8, 16, 8), (3, 8, 32, 8), (2, 4, 4, 3),
                                               (1, 8, 128, 10), (2, 1, 5, 5)])
def test_pool_draw_kernel_draws_what_the_torch_ops_draw(batch, rows, pool, k, compiled):
    """On CUDA a draft level's children from each node's pool are drawn by kernels.pool_draw (the random
    numbers made in the kernel): the same children, in the same order, with the same scores, as the torch
    ops that run on the CPU, from the same logits, seed and step, at every level; in a compiled function too."""
    from fsd_eagle import kernels, tree as tree_module
    from fsd_eagle.rng import DRAW_CHILDREN, RandomStream

    gen = torch.Generator().manual_seed(pool * 7 + k)
    logits = torch.randn(4, batch * rows, 300, generator=gen) * 3
    temperature = torch.rand(batch, generator=gen) + 0.3
    vocab = torch.randperm(1000, generator=gen)[:300].sort().values
    draw = tree_module._pool_children
    on_gpu = torch.compile(draw, fullgraph=True) if compiled else draw
    for device, fn in (("cpu", draw), ("cuda", on_gpu)):
        rng = RandomStream.create(device, 99, batch=batch)
        rng.counter.add_(torch.arange(batch, device=device) + 3)
        words = rng.words(torch.arange(DRAW_CHILDREN, DRAW_CHILDREN + 4, device=device))
        found = [fn(logits[level].to(device), k, pool, vocab.to(device), temperature.to(device), words, level, rows)
                 for level in range(4)]
        if device == "cpu":
            ref = found
    assert kernels.fits_pool_draw(torch.zeros(1, pool, device="cuda"), k)
    for got, want in zip(found, ref):
        assert torch.equal(got.children.cpu(), want.children) and torch.equal(got.tokens.cpu(), want.tokens)
        assert torch.allclose(got.scores.cpu(), want.scores, atol=1e-5)


def test_flex_backend_leaves_transformers_generate_on_stock_sdpa(tiny_llama):
    """The registered attention function hands masks that are not ours to transformers' SDPA."""
    prompt = random_prompt(0, 128)[None]
    model = copy.deepcopy(tiny_llama)
    before = model.generate(prompt, max_new_tokens=8, do_sample=False)
    Target(model).use_attention("flex")
    assert model.config._attn_implementation == "fsd_eagle"
    assert torch.equal(model.generate(prompt, max_new_tokens=8, do_sample=False), before)


def test_attention_backend_errors(tiny_llama, tiny_gemma3):
    with pytest.raises(ConfigError, match="one of sdpa, flex"):
        Target(tiny_llama).use_attention("flash")
    capped = copy.deepcopy(tiny_gemma3)
    capped.config.attn_logit_softcapping = 50.0
    with pytest.raises(ConfigError, match="soft-capping"):
        Target(capped).use_attention("flex")


def check_greedy_exact(arch, model, kind, seeds, backend="sdpa"):
    """decode == the reference loop for every tree shape (and AR decoding), with acceptance checks."""
    engine = _engine(kind, model)
    n_new = 24
    rejected_somewhere = False
    for seed in seeds:
        prompt = random_prompt(seed, 128)
        ref = reference_greedy(model, prompt, n_new)
        ar, ar_stats = run_decode(engine, prompt, n_new, TreeConfig(total_tokens=1), attention=backend)
        assert ar == ref
        assert ar_stats.target_forwards == n_new
        for name, tree in TREES.items():
            out, stats = run_decode(engine, prompt, n_new, tree, attention=backend)
            assert out == ref, f"{arch} {kind} seed {seed} tree {name}"
            assert stats.new_tokens == n_new
            assert all(1 <= a <= tree.depth + 1 for a in stats.accept_lengths)
            if name == "chain":  # every chain has depth nodes: a shorter path means a rejection
                rejected_somewhere |= min(stats.accept_lengths) < tree.depth + 1
            if kind == "noisy":
                assert stats.tau > 1.2, (name, stats.tau)  # paths of several tokens are accepted
            if kind == "self":  # the draft is the target: its greedy path is always accepted
                mean = sum(stats.accept_lengths) / len(stats.accept_lengths)
                if name in ("chain", "depth1", "tiny"):
                    assert mean >= min(tree.depth, tree.total_tokens - 1) + 0.5, (name, stats.accept_lengths)
                else:  # EAGLE-2 reranking may cut the greedy path short on these flat distributions
                    assert mean >= 2.5, (name, stats.accept_lengths)
    if kind == "noisy":
        assert rejected_somewhere  # partial acceptance: both outcomes of the rule are exercised


def test_decode_yields_at_most_max_new_tokens(tiny_llama):
    prompt = random_prompt(0, 128)
    ref = reference_greedy(tiny_llama, prompt, 9)
    for n in (0, 1, 2, 9):
        for kind in (None, "self"):
            out, stats = run_decode(_engine(kind, tiny_llama), prompt, n, TREES["chain"])
            assert out == ref[:n] and stats.new_tokens == n


# ----------------------------------------------------------------- 2. tree and verifier invariants


class PathDrafter:
    """A fake drafter: the logits at a node are a fixed pseudo-random function of its root path (states
    carry the path), so the test can recompute what any node's children should be. It also checks the
    rows_anc protocol: each frontier row must see exactly the draft rows of its ancestors and itself.
    With ``vocab`` (sorted token ids), it drafts among those tokens only, as a draft vocabulary does."""

    def __init__(self, n_vocab: int, cfg: TreeConfig, seed: int, scale: float = 3.0, ties: bool = False,
                 vocab: torch.Tensor | None = None):
        self.n_vocab, self.cfg, self.seed, self.scale, self.ties = n_vocab, cfg, seed, scale, ties
        self.vocab = vocab
        self.table: dict[tuple, torch.Tensor] = {}
        self.rows: dict[int, tuple] = {}

    def logits_for(self, path: tuple) -> torch.Tensor:
        if path not in self.table:
            gen = torch.Generator().manual_seed(hash((self.seed,) + path) % (1 << 62))
            x = torch.randn(self.n_vocab, generator=gen) * self.scale
            self.table[path] = x.round() if self.ties else x  # rounding makes score ties common
        return self.table[path]

    def logits(self, states: torch.Tensor, full: bool = False) -> torch.Tensor:
        flat = states.reshape(-1, states.shape[-1])
        q = torch.stack([self.logits_for(self.path_of(s)) for s in flat]).view(*states.shape[:-1], self.n_vocab)
        return q if full or self.vocab is None else q[..., self.vocab]

    def root(self, root_tokens: list[int]):
        """Draft logits ``[B, V_d]`` and states ``[B, s]`` of batch rows rooted at ``root_tokens``."""
        state = torch.full((len(root_tokens), self.cfg.depth + 1), -1.0)
        state[:, 0] = torch.tensor(root_tokens, dtype=torch.float)
        return self.logits(state), state

    @staticmethod
    def path_of(state: torch.Tensor) -> tuple:
        return tuple(int(t) for t in state.tolist() if t >= 0)

    def step(self, depth, tokens, states, rows_anc):
        k, b = self.cfg.top_k, tokens.shape[0]
        assert tokens.shape == (b, k) and states.shape[:2] == (b, k)
        assert rows_anc.shape == (b, k, (self.cfg.depth - 1) * k) and rows_anc.dtype == torch.bool
        out = states.clone()
        out[:, :, depth] = tokens.float()
        for row in range(b):  # each batch row's draft rows, seen by that row's frontier only
            paths = [self.path_of(s) for s in out[row]]
            for j, path in enumerate(paths):
                assert len(path) == depth + 1
                self.rows[(row, (depth - 1) * k + j)] = path
            for j, path in enumerate(paths):
                seen = {r for r in rows_anc[row, j].nonzero().flatten().tolist()}
                want = {r for r in range(depth * k) if self.rows.get((row, r)) == path[: r // k + 2]}
                assert seen == want, (row, depth, j)
        return self.logits(out), out


class Row:
    """Row ``b`` of a batched DraftTree without the batch dimension (what the checks below read)."""

    FIELDS = ("tokens", "parents", "depths", "anc", "scores", "q_logits", "q_row")

    def __init__(self, tree, b: int = 0) -> None:
        for name in self.FIELDS:
            value = getattr(tree, name)
            setattr(self, name, None if value is None else value[b])
        self.max_depth, self.size = tree.max_depth, tree.size


def node_paths(tree) -> list[tuple]:
    return [tuple(int(t) for t in tree.tokens[tree.anc[i]].tolist()) for i in range(tree.size)]


def reference_candidates(drafter: PathDrafter, root_token: int, cfg: TreeConfig):
    """EAGLE-2 expansion written plainly: {path: cumulative log-prob} and the expanded paths."""
    k = cfg.top_k
    cands: dict[tuple, float] = {}
    frontier = []
    score, tok = torch.log_softmax(drafter.logits_for((root_token,)), -1).topk(k)
    for s, t in zip(score.tolist(), tok.tolist()):
        frontier.append((s, (root_token, t)))
    cands.update({p: s for s, p in frontier})
    expanded = {(root_token,)}
    for _ in range(1, cfg.depth):
        children = []
        for s, path in frontier:
            expanded.add(path)
            cs, ct = torch.log_softmax(drafter.logits_for(path), -1).topk(k)
            children += [(s + c, path + (t,)) for c, t in zip(cs.tolist(), ct.tolist())]
        cands.update({p: s for s, p in children})
        frontier = sorted(children, key=lambda x: -x[0])[:k]
    return cands, expanded


tree_shapes = st.tuples(st.integers(1, 120), st.integers(1, 6), st.integers(1, 6), st.integers(8, 40),
                        st.integers(0, 10_000))


def _make_tree(shape, ties=False, scale=3.0, subset=False, roots=None):
    """A batch of trees ``[B, ...]`` rooted at ``roots`` (default: one row, rooted at seed % vocab)."""
    total, depth, k, n_vocab, seed = shape
    cfg = TreeConfig(total_tokens=total, depth=depth, top_k=k)
    # A draft vocabulary: a random half of the tokens (at least k), as sorted ids.
    vocab = torch.randperm(n_vocab, generator=torch.Generator().manual_seed(seed))[: max(k, n_vocab // 2)].sort().values
    drafter = PathDrafter(n_vocab, cfg, seed, scale=scale, ties=ties, vocab=vocab if subset else None)
    roots = [seed % n_vocab] if roots is None else roots
    root_logits, root_state = drafter.root(roots)
    return draft_tree(drafter, torch.tensor(roots), root_logits, root_state, cfg, with_q=True), drafter, cfg


def _rows_of(tree) -> list:
    return [Row(tree, b) for b in range(tree.batch)]


@settings(max_examples=30, deadline=None)
@given(shape=tree_shapes, ties=st.booleans(), subset=st.booleans())
def test_draft_tree_rows_are_drafted_as_alone(shape, ties, subset):
    """Two batch rows with other roots: each row's tree (nodes, scores, q logits) is the tree of its root
    drafted alone."""
    n_vocab, seed = shape[3], shape[4]
    roots = [seed % n_vocab, (seed * 7 + 3) % n_vocab]
    both = _make_tree(shape, ties, subset=subset, roots=roots)[0]
    assert both.batch == 2
    for b, root in enumerate(roots):
        alone = _make_tree(shape, ties, subset=subset, roots=[root])[0]
        for name in Row.FIELDS:
            torch.testing.assert_close(getattr(both, name)[b], getattr(alone, name)[0], rtol=0, atol=0, msg=name)


@settings(max_examples=80, deadline=None)
@given(shape=tree_shapes, ties=st.booleans(), scale=st.sampled_from([0.5, 3.0, 30.0]), subset=st.booleans())
def test_draft_tree_invariants(shape, ties, scale, subset):
    """Tree structure, scores and q rows; with a draft vocabulary, children come from it only, scores are
    log-probs normalised over it, and q_logits still hold the whole distribution."""
    tree, drafter, cfg = _make_tree(shape, ties, scale, subset)
    tree = Row(tree)
    n, k = tree.size, cfg.top_k
    assert n == min(cfg.total_tokens, 1 + k + (cfg.depth - 1) * k * k)
    parents, depths, anc, scores = tree.parents.tolist(), tree.depths.tolist(), tree.anc, tree.scores
    assert parents[0] == 0 and depths[0] == 0 and float(scores[0]) == 0.0
    assert anc.shape == (n, n) and anc[:, 0].all()
    assert torch.equal(anc[0], torch.nn.functional.one_hot(torch.tensor(0), n).bool())
    assert tree.max_depth == cfg.depth and max(depths) <= cfg.depth
    assert depths == sorted(depths)  # depth-ordered
    for i in range(1, n):
        p = parents[i]
        assert p < i  # connected, parents first
        assert torch.equal(anc[i], anc[p] | torch.nn.functional.one_hot(torch.tensor(i), n).bool())
        assert depths[i] == depths[p] + 1
        assert depths[i] == int(anc[i].sum()) - 1  # positions (L + depth) are path lengths
        assert scores[i] <= scores[p]  # never increases along a path
    # Children of a node: distinct tokens, produced by the logits row q_row points at, scored cumulatively.
    children: dict[int, list[int]] = {}
    for i in range(1, n):
        children.setdefault(parents[i], []).append(i)
    paths = node_paths(tree)
    assert tree.q_row[0] == 0 and torch.equal(tree.q_logits[0], drafter.logits_for(paths[0]))
    for node, kids in children.items():
        row = int(tree.q_row[node])
        assert row >= 0, "a node with children was never expanded"
        q = tree.q_logits[row]
        assert torch.equal(q, drafter.logits_for(paths[node]))  # the row that produced the children
        allowed = torch.zeros(q.shape[0], dtype=torch.bool)
        allowed[drafter.vocab if subset else slice(None)] = True
        logq = torch.log_softmax(q.float().masked_fill(~allowed, float("-inf")), -1)
        toks = tree.tokens[kids]
        assert len(set(toks.tolist())) == len(kids) <= k and allowed[toks].all()
        torch.testing.assert_close(scores[kids], scores[node] + logq[toks])
        kth = logq.topk(k).values[-1]
        assert (logq[toks] >= kth).all()  # children are among the top_k of q (over the draft vocabulary)
    for i in range(n):  # expanded nodes really are: q_row >= 0 exactly where the drafter was called
        if tree.q_row[i] >= 0:
            assert torch.equal(tree.q_logits[tree.q_row[i]], drafter.logits_for(paths[i]))


@settings(max_examples=40, deadline=None)
@given(shape=tree_shapes)
def test_draft_tree_keeps_the_best_eagle2_candidates(shape):
    """Without score ties, the kept nodes are the total_tokens - 1 best of the EAGLE-2 candidates."""
    tree, drafter, cfg = _make_tree(shape)
    tree = Row(tree)
    cands, expanded = reference_candidates(drafter, int(tree.tokens[0]), cfg)
    paths = node_paths(tree)
    kept = paths[1:]
    assert len(set(kept)) == len(kept) and set(kept) <= set(cands)
    for i, path in enumerate(paths[1:], start=1):
        assert math.isclose(float(tree.scores[i]), cands[path], rel_tol=1e-5, abs_tol=1e-5)
        assert (int(tree.q_row[i]) >= 0) == (path in expanded)
    best = sorted(cands.values(), reverse=True)[: tree.size - 1]
    torch.testing.assert_close(torch.tensor(sorted(tree.scores[1:].tolist(), reverse=True)), torch.tensor(best))


def _target_logits_for(tree, vocab: int, seed: int, boost: float = 0.6) -> torch.Tensor:
    """Random target logits where about ``boost`` of the draft nodes get a high logit at their parent."""
    gen = torch.Generator().manual_seed(seed)
    logits = torch.randn(tree.size, vocab, generator=gen)
    for i in range(1, tree.size):
        if torch.rand((), generator=gen) < boost:
            logits[tree.parents[i], tree.tokens[i]] += 10 + torch.rand((), generator=gen)
    return logits


def _check_root_path(tree, verdict) -> list[int]:
    a = int(verdict.n_accepted)
    path = verdict.path.tolist()
    parents = tree.parents.tolist()
    # Padded to max_depth + 1 entries, or to the node count when the tree has fewer nodes than that.
    assert len(path) == min(tree.size, tree.max_depth + 1) and 1 <= a <= len(path)
    assert path[0] == 0
    for i in range(1, a):
        assert parents[path[i]] == path[i - 1]
    assert all(p == path[a - 1] for p in path[a:])
    return path[:a]


def _verdict_row(verdict, b: int):
    """Row ``b`` of a batched Verdict, without the batch dimension."""
    return Verdict(*(getattr(verdict, f.name)[b] for f in dataclasses.fields(Verdict)))


def _assert_same_verdict(got, want) -> None:
    for f in dataclasses.fields(Verdict):
        torch.testing.assert_close(getattr(got, f.name), getattr(want, f.name), rtol=0, atol=0, msg=f.name)


def _two_row_trees(shape, ties=False, boost=0.6):
    """Two batch rows (other roots, other target logits ``[2, n, V]``), and each row's tree alone."""
    vocab, seed = shape[3], shape[4]
    tree = _make_tree(shape, ties, roots=[seed % vocab, (seed * 7 + 3) % vocab])[0]
    logits = torch.stack([_target_logits_for(Row(tree, b), vocab, seed + b, boost) for b in range(2)])
    alone = [_make_tree(shape, ties, roots=[int(tree.tokens[b, 0])])[0] for b in range(2)]
    return tree, logits, alone


@settings(max_examples=60, deadline=None)
@given(shape=tree_shapes, ties=st.booleans())
def test_verify_greedy_accepts_the_greedy_root_path(shape, ties):
    """Each of two batch rows: the greedy root path of its tree, the verdict its tree gets alone."""
    batch, batch_logits, alone = _two_row_trees(shape, ties)
    verdicts = verify(batch, batch_logits, GREEDY)
    for b in range(2):
        _assert_same_verdict(_verdict_row(verdicts, b), _verdict_row(verify(alone[b], batch_logits[b:b + 1], GREEDY), 0))
        tree, logits, verdict = Row(batch, b), batch_logits[b], _verdict_row(verdicts, b)
        path = _check_root_path(tree, verdict)
        argmax, parents, tokens = logits.argmax(-1).tolist(), tree.parents.tolist(), tree.tokens.tolist()
        # Independent walk: follow the child that carries the target's argmax while there is one.
        walk = [0]
        while True:
            kids = [c for c in range(1, tree.size) if parents[c] == walk[-1] and tokens[c] == argmax[walk[-1]]]
            if not kids:
                break
            assert len(kids) == 1
            walk.append(kids[0])
        assert path == walk
        for prev, node in zip(path, path[1:]):
            assert tokens[node] == argmax[prev]
        assert int(verdict.bonus) == argmax[path[-1]]
        assert int(verdict.fuzzy_extra) == 0


@settings(max_examples=30, deadline=None)
@given(shape=tree_shapes, temperature=st.sampled_from([0.5, 1.0, 2.0]), top_p=st.sampled_from([0.5, 0.9, 1.0]))
def test_verify_sampling_accepts_a_root_path(shape, temperature, top_p):
    """Each of two batch rows (each with its own seed): a root path the sampling rule can take, and the
    verdict its tree gets alone with that seed."""
    batch, batch_logits, alone = _two_row_trees(shape, boost=0.3)
    seed = shape[4]
    rule = AcceptanceRule(SamplingConfig(temperature=temperature, top_p=top_p))
    rng = RandomStream.create("cpu", seed, batch=2)
    rng.reseed(seed + 1, 1)
    rngs = [RandomStream.create("cpu", seed + b) for b in range(2)]
    for _ in range(3):
        verdicts = verify(batch, batch_logits, rule, rng)
        for b in range(2):
            _assert_same_verdict(_verdict_row(verdicts, b),
                                 _verdict_row(verify(alone[b], batch_logits[b:b + 1], rule, rngs[b]), 0))
            rngs[b].advance()
            tree, verdict = Row(batch, b), _verdict_row(verdicts, b)
            probs = reference_probs(batch_logits[b], temperature, top_p)
            parents, tokens = tree.parents.tolist(), tree.tokens.tolist()
            path = _check_root_path(tree, verdict)
            for prev, node in zip(path, path[1:]):
                assert probs[prev, tokens[node]] > 0
            last, bonus = path[-1], int(verdict.bonus)
            assert probs[last, bonus] > 0
            kids = {tokens[c] for c in range(1, tree.size) if parents[c] == last}
            if 1 - sum(float(probs[last, t]) for t in kids) > 1e-6:
                assert bonus not in kids  # the bonus comes from the residual without the rejected children
        rng.advance()


# ----------------------------------------------------------------------------------- 3. KV compaction


@torch.no_grad()
@pytest.mark.parametrize("kind", ["noisy", "eagle"])
def test_kv_cache_after_rounds_equals_a_fresh_prefill(arch_model, kind):
    arch, model = arch_model
    session = make_session(tree=TREES["default"], engine=_engine(kind, model))
    target, drafter = session.target, session.drafter
    prompt = random_prompt(2, 128)
    fresh = Target(model)
    generated: list[int] = []
    multi = False
    roots = []  # the draft root (logits, state) after each prefill / commit
    for name in ("prefill", "commit"):
        method = getattr(drafter, name)
        setattr(drafter, name, lambda *a, _method=method, **kw: roots.append(_method(*a, **kw)) or roots[-1])
    rounds = decode(session, prompt, 200, GREEDY)
    for i, new in zip(range(7), rounds):
        generated += new
        multi |= len(new) >= 3
        if i == 0:  # the first round has run already: the scheduler launches it before the prefill's token is read
            continue
        committed = torch.cat([prompt, torch.tensor(generated[:-1], dtype=torch.long)])
        L = committed.shape[0]
        assert target.length.tolist() == [L]
        fresh.allocate(L + 1)
        features = fresh.prefill(committed[None])
        for got, want in zip(target.cache.keys + target.cache.values, fresh.cache.keys + fresh.cache.values):
            torch.testing.assert_close(got[..., :L, :], want[..., :L, :], atol=1e-5, rtol=1e-4)
        if kind == "noisy":  # the draft model's cache holds the root too
            ref = Target(drafter.model.model)
            ref.allocate(L + 2)
            f = ref.prefill(torch.cat([committed, torch.tensor(generated[-1:])])[None])
            want_root = (ref.logits(f[:, -1]), f[:, -1])
            assert drafter.length.tolist() == [L + 1]
            pairs = zip(drafter.model.cache.keys + drafter.model.cache.values, ref.cache.keys + ref.cache.values)
            n = L + 1
        else:  # the head's rows t read (e(x_{t+1}), f_t)
            ref = EagleDrafter(drafter.head, fresh)
            ref.allocate(L + 1, TREES["default"])
            root = ref.prefill(torch.cat([committed, torch.tensor(generated[-1:])])[None], features)
            want_root = (root.logits, root.state)
            assert drafter.length.tolist() == [L]
            pairs = zip([drafter.cache.keys, drafter.cache.values], [ref.cache.keys, ref.cache.values])
            n = L
        for got, want in pairs:
            torch.testing.assert_close(got[..., :n, :], want[..., :n, :], atol=1e-5, rtol=1e-4)
        torch.testing.assert_close(roots[-1].logits, want_root[0], atol=1e-4, rtol=1e-4)
        torch.testing.assert_close(roots[-1].state, want_root[1], atol=1e-5, rtol=1e-4)
    if kind == "noisy":
        assert multi  # some round committed a path of several tokens


@torch.no_grad()
def reference_eagle_logits(head, model, committed: torch.Tensor, path_tokens: torch.Tensor) -> torch.Tensor:
    """The head's draft logits after committed + path (root first), with no cache: head row t reads
    (e(x_{t+1}), F_t), F_t the target's feature for t < L, else the head's own output at row t - 1."""
    L = committed.shape[0]
    seq = torch.cat([committed, path_tokens])
    feats = list(model.model(seq[None, :L]).last_hidden_state[0])
    embed = model.get_input_embeddings()
    out = None
    for rows in range(L, L + path_tokens.shape[0]):  # rows 0 .. rows-1 of the head
        x = head(embed(seq[1: rows + 1])[None], torch.stack(feats)[None], torch.arange(rows)[None])[0]
        out = x[-1]
        feats.append(out)
    logits = model.get_output_embeddings()(out)
    cap = getattr(model.config, "final_logit_softcapping", None)
    return torch.tanh(logits / cap) * cap if cap else logits


@torch.no_grad()
@pytest.mark.parametrize("kind,draft_vocab", [("noisy", 0), ("eagle", 0), ("eagle", 40)])
def test_drafted_logits_match_a_plain_forward_of_the_drafter(arch_model, kind, draft_vocab, monkeypatch):
    """Every expanded tree node's q logits equal the drafter run from scratch over prefix + node path (tree
    masks, draft positions, scratch rows and the drafter's commit), over several rounds. With a draft
    vocabulary, the tree's q logits still cover every token (the fuzzy rule's q_n)."""
    import fsd_eagle.decode as decode_module

    arch, model = arch_model
    engine = _engine(kind, model)
    if draft_vocab:
        engine.head.token_ranking = torch.randperm(model.config.vocab_size, generator=torch.Generator().manual_seed(1))
    trees = []
    real_draft_tree = decode_module.draft_tree
    monkeypatch.setattr(decode_module, "draft_tree",
                        lambda *a, **kw: trees.append(real_draft_tree(*a, with_q=True)) or trees[-1])
    prompt = random_prompt(3, 128)
    generated: list[int] = []
    cfg = TreeConfig(total_tokens=20, depth=4, top_k=3, draft_vocab=draft_vocab)
    session = make_session(tree=cfg, engine=engine)
    drafter = session.drafter
    for i, new in zip(range(4), decode(session, prompt, 200, GREEDY)):
        if i > 0:  # the tree of the round that just ended, drafted after the tokens generated before it
            tree = Row(trees[-1])
            committed = torch.cat([prompt, torch.tensor(generated[:-1], dtype=torch.long)])
            assert int(tree.tokens[0]) == generated[-1]
            for i in range(tree.size):
                if tree.q_row[i] < 0:
                    continue
                path_tokens = tree.tokens[tree.anc[i]]
                if kind == "noisy":
                    ref = drafter.model.model(torch.cat([committed, path_tokens])[None]).logits[0, -1]
                else:
                    ref = reference_eagle_logits(drafter.head, model, committed, path_tokens)
                torch.testing.assert_close(tree.q_logits[tree.q_row[i]], ref, atol=1e-4, rtol=1e-4)
            if draft_vocab:
                assert torch.isin(tree.tokens[1:], engine.head.token_ranking[:draft_vocab]).all()
        generated += new
    assert len(trees) == 3


# ----------------------------------------------------------------------------------- 4. head loading


def _eagle_layout_state(cfg: dict, seed: int = 0) -> dict[str, torch.Tensor]:
    """Random weights under the published EAGLE key names (written out here, not taken from our module);
    with ``qkv_bias`` (EAGLE's Qwen2 heads) q/k/v have biases too."""
    h, i, v = cfg["hidden_size"], cfg["intermediate_size"], cfg["vocab_size"]
    d = h // cfg["num_attention_heads"]
    kv = cfg["num_key_value_heads"] * d
    shapes = {
        "fc.weight": (h, 2 * h), "fc.bias": (h,),
        "layers.0.self_attn.q_proj.weight": (h, h), "layers.0.self_attn.k_proj.weight": (kv, h),
        "layers.0.self_attn.v_proj.weight": (kv, h), "layers.0.self_attn.o_proj.weight": (h, h),
        "layers.0.mlp.gate_proj.weight": (i, h), "layers.0.mlp.up_proj.weight": (i, h),
        "layers.0.mlp.down_proj.weight": (h, i), "layers.0.post_attention_layernorm.weight": (h,),
        "embed_tokens.weight": (v, h),
    }
    if cfg.get("qkv_bias"):
        shapes.update({"layers.0.self_attn.q_proj.bias": (h,), "layers.0.self_attn.k_proj.bias": (kv,),
                       "layers.0.self_attn.v_proj.bias": (kv,)})
    gen = torch.Generator().manual_seed(seed)
    return {k: 0.1 * torch.randn(s, generator=gen) for k, s in shapes.items()}


def _eagle_layout_config(target_config, qkv_bias: bool = False) -> dict:
    c = target_config
    raw = {"architectures": ["LlamaForCausalLM"], "hidden_size": c.hidden_size,
           "intermediate_size": c.intermediate_size, "num_attention_heads": c.num_attention_heads,
           "num_key_value_heads": c.num_key_value_heads, "vocab_size": c.vocab_size, "rms_norm_eps": 1e-5,
           "rope_theta": 10000.0, "max_position_embeddings": c.max_position_embeddings}
    if qkv_bias:
        raw["qkv_bias"] = True
    return raw


@pytest.mark.parametrize("qkv_bias", [False, True])
def test_head_runs_the_published_layers_with_fused_linears(tiny_llama, qkv_bias):
    """The head holds q/k/v and gate/up as one linear each, yet reads and writes EAGLE's separate ones, and
    computes what the separate linears compute."""
    import torch.nn.functional as F

    raw = _eagle_layout_config(tiny_llama.config, qkv_bias)
    state = {k: v for k, v in _eagle_layout_state(raw).items() if k != "embed_tokens.weight"}
    head = EagleHead(HeadConfig.for_target(tiny_llama.config, attention_bias=qkv_bias, rms_norm_eps=1e-5)).eval()
    head.load_state_dict(state)
    saved = head.state_dict()
    assert set(saved) == set(state) and all(torch.equal(saved[k], state[k]) for k in state)
    x = torch.randn(1, 5, raw["hidden_size"], generator=torch.Generator().manual_seed(1))
    attn, mlp = head.layers[0].self_attn, head.layers[0].mlp

    def linear(name):
        bias = state.get(f"layers.0.{name}.bias")
        return F.linear(x, state[f"layers.0.{name}.weight"], bias)

    fused = attn.qkv_proj(x).split(attn.fused_sizes["qkv_proj"], dim=-1)
    for got, name in zip(fused, ("q_proj", "k_proj", "v_proj")):
        torch.testing.assert_close(got, linear(f"self_attn.{name}"))
    torch.testing.assert_close(mlp(x), F.linear(F.silu(linear("mlp.gate_proj")) * linear("mlp.up_proj"),
                                                state["layers.0.mlp.down_proj.weight"]))


def _assert_decodes_exactly(model, head):
    engine = Engine(model, None, head=head)
    prompt = random_prompt(4, 128)
    ref = reference_greedy(model, prompt, 16)
    for tree in (TREES["default"], TREES["chain"]):
        assert run_decode(engine, prompt, 16, tree)[0] == ref


@pytest.mark.parametrize("arch,weights_file", [("llama", "pytorch_model.bin"), ("llama", "model.safetensors"),
                                               ("qwen2", "pytorch_model.bin")])
def test_published_eagle_layout_head_loads_and_decodes(tmp_path, tiny_llama, tiny_qwen2, arch, weights_file):
    from safetensors.torch import save_file

    model = tiny_llama if arch == "llama" else tiny_qwen2
    raw = _eagle_layout_config(model.config, qkv_bias=arch == "qwen2")
    state = _eagle_layout_state(raw)
    (tmp_path / "config.json").write_text(json.dumps(raw))
    if weights_file.endswith(".bin"):
        torch.save(state, tmp_path / weights_file)
    else:
        save_file(state, tmp_path / weights_file)
    head = load_head(tmp_path, model.config, CPU, torch.float32)
    loaded = head.state_dict()
    assert set(loaded) == set(state) - {"embed_tokens.weight"}  # nothing dropped but the embedding
    for key, value in loaded.items():
        assert torch.equal(value, state[key]), key
    assert head.config.rms_norm_eps == 1e-5
    _assert_decodes_exactly(model, head)


def test_head_weights_that_would_be_ignored_are_refused(tmp_path, tiny_llama):
    from fsd_eagle.errors import HeadMismatchError

    raw = _eagle_layout_config(tiny_llama.config)
    state = _eagle_layout_state(raw)
    state["layers.1.post_attention_layernorm.weight"] = torch.ones(raw["hidden_size"])  # a 2-layer head
    (tmp_path / "config.json").write_text(json.dumps(raw))
    torch.save(state, tmp_path / "pytorch_model.bin")
    with pytest.raises(HeadMismatchError, match="layers.1"):
        load_head(tmp_path, tiny_llama.config, CPU, torch.float32)


def test_own_head_format_round_trip(tmp_path, tiny_llama):
    torch.manual_seed(7)
    head = EagleHead(HeadConfig.for_target(tiny_llama.config)).eval()
    save_head(head, tmp_path / "fp32", dtype=torch.float32)
    save_head(head, tmp_path / "bf16")  # default: bfloat16 weights
    exact = load_head(tmp_path / "fp32", tiny_llama.config, CPU, torch.float32)
    rounded = load_head(tmp_path / "bf16", tiny_llama.config, CPU, torch.float32)
    assert exact.config == head.config
    for key, value in head.state_dict().items():
        assert torch.equal(exact.state_dict()[key], value), key
        assert torch.equal(rounded.state_dict()[key], value.bfloat16().float()), key
    _assert_decodes_exactly(tiny_llama, exact)


# ------------------------------------------------------------------- 5. sampling is lossless


STAT_VOCAB = 12


def make_stat_setup():
    """A one-layer model with a small vocabulary, a noisy copy as the drafter, and a fixed prompt."""
    model = tiny_model("llama", vocab_size=STAT_VOCAB, hidden_size=32, num_layers=1, initializer_range=0.3, seed=3)
    prompt = torch.tensor([1, 5, 3, 7])
    with torch.no_grad():
        first = model(prompt[None]).logits[0, -1]
        second = model(torch.cat([prompt.expand(STAT_VOCAB, -1), torch.arange(STAT_VOCAB)[:, None]], 1)).logits[:, -1]
    return model, Engine(model, None, draft_model=noisy_copy(model, 0.2)), prompt, first, second


@pytest.fixture(scope="module")
def stat_setup():
    return make_stat_setup()


def exact_pair_distribution(first, second, temperature, top_p) -> dict:
    p1 = reference_probs(first, temperature, top_p)
    p2 = reference_probs(second, temperature, top_p)
    return {(a, b): float(p1[a] * p2[a, b]) for a, b in product(range(STAT_VOCAB), repeat=2)}


# Only the root's children decide the second token: a depth-1 tree keeps each sample cheap.
STAT_TREE = TreeConfig(total_tokens=4, depth=1, top_k=3)


def sample_pairs(setup, rule, n, seed, tree=STAT_TREE, ranking=None):
    """n two-token decodes, each with its own seed, on one session (draft vocabulary: ``ranking``)."""
    _, engine, prompt, _, _ = setup
    session = make_session(tree=tree, rule=rule, engine=engine, batch=CHI_ROWS)
    if ranking is not None:  # the rows' drafter and those that prompts are prefilled with
        for drafter in [session.drafter] + [rows.drafter for rows in session.prefill_rows.values()]:
            drafter.ranking = ranking
    return sample_pairs_on(session, prompt, rule, n, seed)


@pytest.mark.parametrize("temperature,top_p,n", [(1.0, 1.0, 2000), (0.7, 0.9, 2000)])
def test_sampling_decode_is_lossless(stat_setup, temperature, top_p, n):
    rule = AcceptanceRule(SamplingConfig(temperature=temperature, top_p=top_p))
    counts, accept_rate = sample_pairs(stat_setup, rule, n, seed=0)
    assert accept_rate > 0.3  # the draft's children are really accepted, often
    expected = exact_pair_distribution(stat_setup[3], stat_setup[4], temperature, top_p)
    assert chi_square_pvalue(counts, expected, n) > 1e-3


@pytest.mark.parametrize("temperature,top_p", [(1.0, 1.0), (0.7, 0.9)])
def test_sampling_decode_is_lossless_through_the_transposed_cpu_projection(stat_setup, monkeypatch, mm_calls,
                                                                           temperature, top_p):
    """The chi-square test of sampled decoding with every vocabulary projection of the round taking
    ``ops.project``'s ``weight @ x.T`` (its size threshold lowered to this model's lm_head)."""
    from fsd_eagle import ops

    monkeypatch.setattr(ops, "LARGE_WEIGHT", 1)
    rule = AcceptanceRule(SamplingConfig(temperature=temperature, top_p=top_p))
    counts, accept_rate = sample_pairs(stat_setup, rule, 2000, seed=2)
    assert accept_rate > 0.3
    assert (STAT_VOCAB, 32) in mm_calls
    expected = exact_pair_distribution(stat_setup[3], stat_setup[4], temperature, top_p)
    assert chi_square_pvalue(counts, expected, 2000) > 1e-3


def test_sampling_with_a_draft_vocabulary_is_lossless(stat_setup):
    """Drafting among half the tokens changes which children are proposed, never the output distribution."""
    first, second = stat_setup[3:]
    ranking = torch.randperm(STAT_VOCAB, generator=torch.Generator().manual_seed(4))
    rule = AcceptanceRule(SamplingConfig(temperature=1.0))
    counts, accept_rate = sample_pairs(stat_setup, rule, 2000, seed=1, tree=TreeConfig(4, 1, 3, draft_vocab=STAT_VOCAB // 2),
                                       ranking=ranking)
    assert accept_rate > 0.2
    assert chi_square_pvalue(counts, exact_pair_distribution(first, second, 1.0, 1.0), 2000) > 1e-3


def _break_acceptance(monkeypatch):
    """Accept a child with probability min(1, 2 p / residual) instead of p / residual (u is halved)."""
    uniform = RandomStream.uniform
    monkeypatch.setattr(RandomStream, "uniform",
                        lambda self, shape, draw: uniform(self, shape, draw) * (0.5 if draw == DRAW_ACCEPT else 1.0))


def _break_residual(monkeypatch):
    """Sample the bonus from p without removing the rejected children."""
    monkeypatch.setattr(verify_module, "_remove", lambda p, tokens, drop: p)


BROKEN = {"double_acceptance": _break_acceptance, "keep_rejected": _break_residual}


@pytest.mark.parametrize("broken", sorted(BROKEN))
def test_sampling_test_detects_a_broken_rule(stat_setup, monkeypatch, broken):
    BROKEN[broken](monkeypatch)
    rule = AcceptanceRule(SamplingConfig(temperature=1.0))
    n = 400  # the effect is large: p-values below 1e-13 at 600 samples
    counts, _ = sample_pairs(stat_setup, rule, n, seed=0)
    expected = exact_pair_distribution(stat_setup[3], stat_setup[4], 1.0, 1.0)
    assert chi_square_pvalue(counts, expected, n) < 1e-3


def _synthetic_tree(batch: int = 1):
    """root(0) -> children tokens 2, 0, 4 (draft order); node 1 (token 2) -> 1, 3; node 4 (token 1) -> 5;
    the same tree in each of ``batch`` rows."""
    from fsd_eagle.tree import DraftTree

    tokens = torch.tensor([5, 2, 0, 4, 1, 3, 5])
    parents = torch.tensor([0, 0, 0, 0, 1, 1, 4])
    depths = torch.tensor([0, 1, 1, 1, 2, 2, 3])
    scores = torch.tensor([0.0, -0.5, -1.0, -2.0, -1.0, -1.5, -1.2])
    n = tokens.shape[0]
    rows = [t.expand(batch, *t.shape) for t in (tokens, parents, depths, ancestors(parents), scores)]
    return DraftTree(*rows, None, torch.full((batch, n), -1), max_depth=3)


def exact_sequence_distribution(tree, probs: torch.Tensor) -> dict:
    """Probability of each generated sequence (accepted drafts, then the bonus): a walk from the root that
    continues while the token is a child of the current node."""
    children = {}
    for c in range(1, tree.size):
        children.setdefault(int(tree.parents[c]), {})[int(tree.tokens[c])] = c
    dist = {}

    def walk(node, prefix, prob):
        for tok in range(probs.shape[1]):
            p = prob * float(probs[node, tok])
            if p == 0:
                continue
            child = children.get(node, {}).get(tok)
            if child is None:
                dist[prefix + (tok,)] = p
            else:
                walk(child, prefix + (tok,), p)

    walk(0, (), 1.0)
    return dist


SAMPLE_ROWS = 50


def sample_verify(tree, logits, rule, n, seed):
    """n verdicts of ``tree`` (a batch of SAMPLE_ROWS copies, each row with its own seed) under ``logits``
    ``[n_nodes, V]``: n / SAMPLE_ROWS steps of every row's stream."""
    b = tree.batch
    rng = RandomStream.create("cpu", batch=b)
    for row in range(b):
        rng.reseed(seed * b + row, row)
    counts: Counter = Counter()
    for _ in range(n // b):
        v = verify(tree, logits.expand(b, *logits.shape), rule, rng)
        rng.advance()
        for row in range(b):
            a = int(v.n_accepted[row])
            seq = tuple(int(t) for t in tree.tokens[row, v.path[row, 1:a]].tolist()) + (int(v.bonus[row]),)
            counts[seq] += 1
    return counts


SYNTH_LOGITS = torch.tensor([
    [0.5, 0.0, 1.5, -1.0, 1.0, -0.5],
    [0.0, 1.2, -0.3, 0.9, 0.1, -1.0],
    [1.0, -1.0, 0.0, 0.5, 0.2, 0.3],
    [0.3, 0.3, 0.3, -2.0, 1.0, 0.0],
    [-0.5, 0.4, 0.8, 0.0, 0.2, 1.1],
    [0.0, 0.0, 1.0, 1.0, -1.0, 0.5],
    [1.0, 0.5, 0.0, -0.5, -1.0, 0.2],
])


@pytest.mark.parametrize("temperature,top_p", [(1.0, 1.0), (0.7, 0.9)])
def test_verify_sampling_matches_the_target_distribution(temperature, top_p):
    tree = _synthetic_tree(SAMPLE_ROWS)
    rule = AcceptanceRule(SamplingConfig(temperature=temperature, top_p=top_p))
    n = 2500
    counts = sample_verify(tree, SYNTH_LOGITS, rule, n, seed=1)
    expected = exact_sequence_distribution(Row(tree), reference_probs(SYNTH_LOGITS, temperature, top_p))
    assert abs(sum(expected.values()) - 1) < 1e-9
    assert sum(c for s, c in counts.items() if len(s) > 2) > 0.1 * n  # deep paths are exercised
    assert chi_square_pvalue(counts, expected, n) > 1e-3


@pytest.mark.parametrize("broken", sorted(BROKEN))
def test_verify_statistical_test_detects_a_broken_rule(monkeypatch, broken):
    BROKEN[broken](monkeypatch)
    tree = _synthetic_tree(SAMPLE_ROWS)
    n = 1000
    counts = sample_verify(tree, SYNTH_LOGITS, AcceptanceRule(SamplingConfig(temperature=1.0)), n, seed=1)
    expected = exact_sequence_distribution(Row(tree), reference_probs(SYNTH_LOGITS, 1.0, 1.0))
    assert chi_square_pvalue(counts, expected, n) < 1e-3


# ------------------------------------------------------------- 6. pipelined rounds and compiled rounds


class AheadSession(Session):
    """Eager rounds that the scheduler launches one round ahead of reading, as it does with CUDA graphs, and
    prompts padded to their bucket, as graph sessions pad them (their prefill runs eagerly where it does
    not capture: ``capture_first`` must be patched to find nothing)."""

    def __init__(self, *args) -> None:
        super().__init__(*args)
        self.use_graph = True  # the scheduler pipelines graph sessions
        self.launches = 0
        self.events: list[str] = []  # "launch" / "read", in order

    def launch(self):
        self.launches += 1
        self.events.append("launch")
        events = self.events

        class Logged(PendingRound):
            def results(self):
                events.append("read")
                return super().results()

        return Logged(run_round(self.target, self.drafter, self.state, self.tree, self.form).cpu())


@pytest.mark.parametrize("tree", ["chain", "tiny", "default"])
def test_pipelined_rounds_decode_exactly_and_fit_the_cache(tiny_llama, tree, monkeypatch):
    """Rounds launched ahead decode exactly; none is launched past max_new_tokens, and any fits the cache:
    max_new_tokens is chosen so that plan_cache's need is exactly a multiple of its granularity, and the
    self-draft accepts whole paths, so the last round overshoots max_new_tokens as far as it can. The
    prompt is padded to its bucket, as graph sessions do."""
    monkeypatch.setattr(session_module, "capture_first", lambda candidates, state, pool=None: None)
    cfg = TREES[tree]
    engine = _engine("self", tiny_llama)
    prompt = random_prompt(3, 128)
    session = AheadSession(engine, Plan(cfg, GREEDY.form))
    slots = session.prompt_slots(prompt.shape[0])
    assert slots == 64 > prompt.shape[0]
    n = 256 - slots - 2 * cfg.depth - cfg.total_tokens - 3
    assert plan_cache(slots, n, cfg) == 256 and plan_cache(slots, n + 1, cfg) == 512
    ref, _ = run_decode(engine, prompt, n, cfg)
    assert ref == reference_greedy(tiny_llama, prompt, n)
    stats = DecodeStats()
    out = [t for new in decode(session, prompt, n, GREEDY, 0, stats) for t in new]
    assert out == ref
    assert session.max_len == 256  # the cache planned for a padded prompt
    # every launched round was used (the prefill is one forward): none ran ahead past max_new_tokens
    assert session.launches == stats.target_forwards - 1
    # ... while the rounds before the last ones were launched ahead, before their predecessor was read
    events = session.events
    ahead = sum(e == "launch" and events[:i].count("launch") > events[:i].count("read") for i, e in enumerate(events))
    most = min(cfg.depth, cfg.total_tokens - 1) + 1  # rounds that may end the call: at most this many
    assert session.launches - 1 - most <= ahead < session.launches, events
    assert max(stats.accept_lengths) == most or tree == "default"  # the most one round can accept


@torch.no_grad()
@pytest.mark.parametrize("kind", ["eagle", "noisy"])
def test_padded_prefill_equals_the_plain_one(tiny_llama, kind):
    """Prompts padded to a bucket (graph sessions), two of other lengths in one batch, leave each row the
    prefix and roots of its prompt's plain prefill."""
    prompts = [random_prompt(2, 128), random_prompt(5, 128)]
    assert prompts[0].shape[0] != prompts[1].shape[0]
    cfg = TREES["default"]
    engine = _engine(kind, tiny_llama)

    def run(ids, n):
        target = engine.new_target()
        drafter = engine.new_drafter(target)
        target.allocate(256, ids.shape[0])
        drafter.allocate(256, cfg, ids.shape[0])
        root_token, root = prefill(target, drafter, ids, n, GREEDY.form, RuleValues.create("cpu", ids.shape[0]),
                                   RandomStream.create("cpu", batch=ids.shape[0]))
        return root_token, root.logits, root.state, target.length, drafter.length

    size = max(prefill_bucket(p.shape[0]) for p in prompts)
    assert size > max(p.shape[0] for p in prompts)
    ids = torch.full((2, size), 7)
    for b, p in enumerate(prompts):
        ids[b, : p.shape[0]] = p
    padded = run(ids, torch.tensor([p.shape[0] for p in prompts]))
    for b, p in enumerate(prompts):
        plain = run(p[None], torch.tensor([p.shape[0]]))
        for got, want in zip(padded, plain):
            torch.testing.assert_close(got[b: b + 1], want, atol=1e-5, rtol=1e-5)


def test_a_round_flex_cannot_capture_switches_to_sdpa(tiny_llama, monkeypatch):
    """If the flex round cannot be compiled or captured, the session captures SDPA rounds instead (eager
    flex is only a slow reference); if that fails too, rounds run eagerly with SDPA."""
    import fsd_eagle.decode as decode_module

    seen = []

    def failing_capture(fn, state, pool=None):
        seen.append(session.target.attention)  # the prefill (always SDPA) is captured too
        return None

    monkeypatch.setattr(decode_module, "capture", failing_capture)  # prefills (through capture_first)
    monkeypatch.setattr(session_module, "capture", failing_capture)  # rounds
    model = copy.deepcopy(tiny_llama)
    cfg = TREES["default"]
    prompt = random_prompt(4, 128)
    session = make_session(tree=cfg, engine=_engine("eagle", model), graphs=True, compile=True, attention="flex")
    # A GPU session's settings (on the CPU a session runs eagerly from the start).
    session.use_graph, session.compile, session.attention = True, True, "flex"
    out = [t for new in decode(session, prompt, 12, GREEDY) for t in new]
    # compiled with flex, compiled with SDPA, then eager kernels with SDPA: none captures
    assert seen[-3:] == ["flex", "sdpa", "sdpa"] and session.attention == "sdpa" and session.mode == "eager"
    assert out == reference_greedy(model, prompt, 12)


@pytest.mark.skipif(not has_cpu_compiler(), reason="torch.compile on the CPU needs g++ and Python headers")
def test_compiled_prefill_equals_the_eager_one(tiny_llama):
    """What compiled GPU runners capture for a padded prompt (decode.compiled_prefill) leaves the same
    prefix, caches and roots as the eager prefill."""
    torch._dynamo.reset()
    prompt = random_prompt(5, 128)
    cfg = TREES["default"]
    size = prefill_bucket(prompt.shape[0])
    results = []
    engine = _engine("eagle", tiny_llama)
    for fn in (prefill, compiled_prefill()):
        target = engine.new_target()
        drafter = engine.new_drafter(target)
        target.allocate(256)
        drafter.allocate(256, cfg)
        ids = torch.zeros(1, size, dtype=torch.long)
        ids[0, : prompt.shape[0]] = prompt
        root_token, root = fn(target, drafter, ids, torch.tensor([prompt.shape[0]]), GREEDY.form, GREEDY.values(),
                              RandomStream.create("cpu"))
        n = prompt.shape[0]
        results.append((root_token, root.logits, root.state, target.length.clone(), drafter.length.clone(),
                        target.cache.kv[..., :n, :].clone(), drafter.cache.keys[..., :n, :].clone(),
                        drafter.cache.values[..., :n, :].clone()))
    for eager, compiled in zip(*results):
        torch.testing.assert_close(compiled, eager, atol=1e-5, rtol=1e-5)


def test_transformers_attention_flag_is_as_before_after_a_compiled_call():
    """``attention_flag_kept`` finds the ``kernels`` package's flag where that package is installed (its form is
    what the workaround relies on: a changed package fails here, not as slow extra compilations) and puts it
    back as it was, as after a compiled FlexAttention round whose reset dynamo dropped."""
    pytest.importorskip("kernels")
    import importlib

    import fsd_eagle.target as target_module

    importlib.import_module("kernels._internals.layer.layer")
    flag = target_module._attention_flag()
    assert flag is not None, "the kernels package's active-kernel flag has another form now"
    before = flag.global_var, flag.uses_global_var
    with target_module.attention_flag_kept():
        flag.global_var, flag.uses_global_var = {1: 2}, True  # the set without its reset
    assert (flag.global_var, flag.uses_global_var) == before


@pytest.mark.filterwarnings("ignore:.*flex_attention.*")
@pytest.mark.parametrize("kind", ["eagle", "noisy"])
def test_sessions_of_one_plan_share_their_compilations(tiny_llama, kind, monkeypatch):
    """What a GPU session compiles (its prefill, then its FlexAttention round), counted per function by
    dynamo: a second and a third Session of the same plan compile nothing new. (The first Session's round
    switches the shared model to the registered attention function, which compiled prefills guard on: before
    Sessions routed attention ahead of compiling, the second Session compiled its prefill again. And where
    dynamo drops a mutation made after FlexAttention, the first FlexAttention round of the process would leave
    transformers' attention flag set and the second Session compile each function once more, but for
    ``target.attention_flag_kept`` around every compiled call.)"""
    from torch._dynamo.testing import CompileCounter

    counters: dict = {}
    gpu_session_on_the_cpu(monkeypatch, lambda fn: counters.setdefault(fn.__name__, CompileCounter()))
    compiled_round.cache_clear()
    torch._dynamo.reset()
    try:
        cfg = TreeConfig(total_tokens=12, depth=4, top_k=3)
        eng = _engine(kind, copy.deepcopy(tiny_llama))
        frames = []
        for i in range(3):
            session = make_session(tree=cfg, engine=eng, graphs=True, compile=True)
            session.use_graph, session.compile, session.attention = True, True, "flex"  # a GPU session's
            session.allocate(256)
            session.start(0, random_prompt(i, 128), AcceptanceRule(), i)  # the prefill
            assert session._capture_round() is not None and session.attention == "flex"
            frames.append({name: c.frame_count for name, c in counters.items()})
        assert frames[0] == frames[1] == frames[2] == {"prefill": 1, "run_round": 1}, frames
    finally:
        compiled_prefill.cache_clear()  # later tests compile with inductor again
        compiled_round.cache_clear()
        torch._dynamo.reset()


@pytest.mark.filterwarnings("ignore:.*flex_attention.*")
def test_batch_sessions_compile_their_prefills_once_for_two_or_more_rows(tiny_llama, monkeypatch):
    """A batched GPU Session compiles its prefills as one-row Sessions do: prefills of 4 and 2 rows share one
    compilation (rows symbolic), one row compiles its own; every started row holds what an eager prefill of
    its prompt leaves (first token, root, cache slots)."""
    from torch._dynamo.testing import CompileCounter

    counter = CompileCounter()
    gpu_session_on_the_cpu(monkeypatch, lambda fn: counter)
    torch._dynamo.reset()
    try:
        cfg = TreeConfig(total_tokens=12, depth=4, top_k=3)
        eng = _engine("eagle", copy.deepcopy(tiny_llama))
        prompts = [random_prompt(i, 128, 5, 9) for i in range(7)]
        sessions = []
        for gpu in (True, False):
            session = make_session(tree=cfg, engine=eng, graphs=True, compile=True, batch=8)
            session.use_graph, session.compile = gpu, gpu  # a GPU session's settings, or eager prefills
            session.allocate(256)
            rule = AcceptanceRule()
            session.start_rows([0, 1, 2, 3], prompts[:4], [rule] * 4, [0] * 4)  # a prefill of 4 rows
            frames = [counter.frame_count]
            session.start_rows([4, 5], prompts[4:6], [rule] * 2, [0] * 2)  # of 2 rows
            frames.append(counter.frame_count)
            session.start_rows([6], prompts[6:], [rule], [0])  # of 1 row
            frames.append(counter.frame_count)
            if gpu:
                assert frames == [1, 1, 2], frames
            sessions.append(session)
        compiled, eager = sessions
        assert torch.equal(compiled.state.root_token[:7], eager.state.root_token[:7])
        torch.testing.assert_close(compiled.state.root_logits[:7], eager.state.root_logits[:7])
        for row, p in enumerate(prompts):
            n = p.shape[0]
            kv = compiled.target.cache.kv, eager.target.cache.kv
            torch.testing.assert_close(kv[0][:, :, row, :, :n], kv[1][:, :, row, :, :n])
    finally:
        compiled_prefill.cache_clear()
        torch._dynamo.reset()


@pytest.mark.filterwarnings("ignore:.*flex_attention.*")
@pytest.mark.parametrize("backend", ["sdpa", "flex"])
def test_a_round_is_one_graph_for_dynamo(tiny_llama, backend):
    """No graph break in run_round (each break splits inductor's fusion and adds launches to the round)."""
    torch._dynamo.reset()
    model = copy.deepcopy(tiny_llama)
    cfg = TreeConfig(total_tokens=12, depth=4, top_k=3)
    session = make_session(tree=cfg, engine=_engine("eagle", model))
    session.attention = backend
    next(decode(session, random_prompt(1, 128), 2, GREEDY))
    assert session.target.attention == backend
    report = torch._dynamo.explain(run_round)(session.target, session.drafter, session.state, cfg, GREEDY.form)
    assert (report.graph_count, report.graph_break_count) == (1, 0), report.break_reasons


@pytest.mark.skipif(not has_cpu_compiler(), reason="torch.compile on the CPU needs g++ and Python headers")
@pytest.mark.parametrize("kind", ["noisy", "eagle"])
def test_batched_compiled_round_equals_eager_and_compiles_once_for_later_batch_sizes(tiny_llama, kind):
    """Batch sessions' compiled round (``compiled_round(True)``), with a draft model or a head: every row's
    outputs equal the eager round's, at batch sizes 2, 3 and 5 (greedy and sampled rows mixed), and the
    first compilation (batch 2) already has the batch size symbolic: batches 3 and 5 compile nothing new."""
    from torch._dynamo.utils import counters

    torch._dynamo.reset()
    start = counters["stats"]["unique_graphs"]
    cfg = TreeConfig(total_tokens=12, depth=4, top_k=3)
    eng = _engine(kind, copy.deepcopy(tiny_llama))
    rules = [AcceptanceRule(), AcceptanceRule(SamplingConfig(temperature=0.8))]
    form = rules[1].form
    graphs = []
    for b in (2, 3, 5):
        outs = []
        for fn in (run_round, compiled_round(True)):
            session = make_session(tree=cfg, engine=eng, rule=rules[1], batch=b)
            session.allocate(256)
            ps = [random_prompt(i, 128, 5 + 3 * i, 5 + 3 * i) for i in range(b)]
            session.start_rows(list(range(b)), ps, [rules[i % 2] for i in range(b)], list(range(b)))
            with torch._inductor.config.patch(cpu_kernels(session.attention)):
                outs.append(torch.stack([fn(session.target, session.drafter, session.state, cfg, form)
                                         for _ in range(4)]))
        assert torch.equal(outs[0], outs[1]), b
        graphs.append(counters["stats"]["unique_graphs"] - start)
    assert graphs[0] > 0 and graphs == [graphs[0]] * 3, graphs  # batches 3 and 5 reused batch 2's compilation


@pytest.mark.skipif(not has_cpu_compiler(), reason="torch.compile on the CPU needs g++ and Python headers")
@pytest.mark.parametrize("window", [None, 64])
@pytest.mark.parametrize("shared", [False, True])
def test_flex_block_lists_keep_a_symbolic_batch_size(window, shared):
    """FlexAttention's block lists (``block_mask``, per row or shared), compiled as batched rounds are (batch
    dimension marked dynamic), equal the eager lists, and nothing fixes the batch size, not even where it
    equals the number of key blocks (2 here): batch 3 reuses batch 2's compilation."""
    from torch._dynamo.utils import counters

    from fsd_eagle.decode import _compile

    def lists(prefix, anc, positions):
        mask = SlotMask(prefix, anc, 2 * FLEX_BLOCK)
        block = block_mask(mask if window is None else mask.windowed(positions, window), shared)
        return block.kv_num_blocks, block.kv_indices, block.full_kv_num_blocks, block.full_kv_indices

    torch._dynamo.reset()
    start = counters["stats"]["unique_graphs"]
    compiled = _compile(lists, dynamic=True)
    for b in (2, 3):
        prefix = torch.tensor([5, 130, 200][:b])
        anc = torch.ones(4, 4, dtype=torch.bool).tril().expand(b, 4, 4).clone()
        args = (prefix, anc, prefix.unsqueeze(1) + torch.arange(4))
        for t in args:
            torch._dynamo.maybe_mark_dynamic(t, 0)
        for got, want in zip(compiled(*args), lists(*args)):
            assert torch.equal(got, want), b
    assert counters["stats"]["unique_graphs"] - start == 1


@pytest.mark.skipif(not has_cpu_compiler(), reason="torch.compile on the CPU needs g++ and Python headers")
@pytest.mark.skipif(not hasattr(torch._inductor.config.triton, "coalesce_tiling_analysis"),
                    reason="this torch has no coalescing analysis of tilings")
@pytest.mark.parametrize("dynamic,batched", [(False, False), (True, False), (True, True)])
def test_batched_round_compilations_turn_off_the_tiling_coalescing_analysis(dynamic, batched):
    """Inductor's coalescing analysis of Triton tilings failed an internal assertion on a symbolic batch size
    (FSD's batched rounds, H200): ``_compile`` turns it off while compiling batched rounds only (prefills
    and one-row rounds keep it). The compiled function reads the setting as it is while being traced."""
    from fsd_eagle.decode import _compile, inductor_settings

    assert inductor_settings(False, batched).get("triton.coalesce_tiling_analysis", True) is not batched

    def seen(x):
        return x + float(torch._inductor.config.triton.coalesce_tiling_analysis)

    torch._dynamo.reset()
    with torch._inductor.config.patch({"triton.coalesce_tiling_analysis": True}):
        got = _compile(seen, dynamic=dynamic, batched=batched)(torch.zeros(3))
        assert torch._inductor.config.triton.coalesce_tiling_analysis  # restored after the call
    assert torch.equal(got, torch.full((3,), 0.0 if batched else 1.0))


@pytest.mark.skipif(not has_cpu_compiler(), reason="torch.compile on the CPU needs g++ and Python headers")
@pytest.mark.filterwarnings("ignore:.*flex_attention.*")
@pytest.mark.parametrize("backend,draft_vocab,freeze", [("sdpa", 0, False), ("flex", 0, False), ("sdpa", 64, False),
                                                        ("sdpa", 0, True)])
def test_compiled_round_equals_the_eager_round(tiny_llama, backend, draft_vocab, freeze, request):
    """What the GPU path compiles (decode.compiled_round, one graph for the whole round) gives the eager
    round's outputs, round after round, with a drafter and a tree whose paths are partly accepted (also
    with a draft vocabulary, and with inductor's freezing, whose fused matmuls must not change a token)."""
    torch._dynamo.reset()
    if freeze:
        request.getfixturevalue("inductor_freezing")
    cfg = TreeConfig(total_tokens=12, depth=4, top_k=3, draft_vocab=draft_vocab)
    results = []
    model = copy.deepcopy(tiny_llama)
    for fn in (run_round, compiled_round()):
        session = make_session(tree=cfg, engine=_engine("noisy", model))
        session.drafter.ranking = torch.randperm(128, generator=torch.Generator().manual_seed(2))
        session.attention = backend
        prompt = random_prompt(1, 128)
        next(decode(session, prompt, 2, GREEDY))  # the prefill and one round
        target, drafter = session.target, session.drafter
        assert target.attention == drafter.model.attention == backend
        if freeze and fn is not run_round:  # the first call compiles: its code holds the weights as constants
            from torch._inductor.utils import run_and_get_code

            first, code = run_and_get_code(fn, target, drafter, session.state, cfg, GREEDY.form)
            assert "_frozen_param" in "\n".join(code)
            rounds = [first] + [fn(target, drafter, session.state, cfg, GREEDY.form) for _ in range(4)]
        else:
            with torch._inductor.config.patch(cpu_kernels(backend)):
                rounds = [fn(target, drafter, session.state, cfg, GREEDY.form) for _ in range(5)]
        results.append(torch.stack(rounds))
    assert torch.equal(results[0], results[1])
    assert (results[0][:, 0, 0] > 1).any()  # some round accepted drafted tokens (n_accepted of row 0)


def test_prefill_attention_reads_only_the_prompts_slots(monkeypatch):
    """A model loaded with SDPA runs our attention function from its first Target on; a prefill into an
    empty cache then attends over its own L slots, not the whole cache (its mask has L columns), and a
    tree forward over the whole cache; the EAGLE head's prefill too. The outputs are checked against the
    model's own forward elsewhere (test_target_logits_match_the_models_own_forward)."""
    import torch.nn.functional as F

    from fsd_eagle.drafter import EagleDrafter
    from fsd_eagle.head import EagleHead, HeadConfig
    from fsd_eagle.target import Target

    model = tiny_model("llama", seed=5)  # a fresh model: a Target over a cached one may have routed it already
    assert model.config._attn_implementation == "sdpa"
    target = Target(model)
    assert target.routed
    target.allocate(256)
    keys: list[int] = []
    real = F.scaled_dot_product_attention

    def spy(q, k, v, *args, **kwargs):
        keys.append(k.shape[-2])
        return real(q, k, v, *args, **kwargs)

    monkeypatch.setattr(F, "scaled_dot_product_attention", spy)
    tokens = torch.randint(0, 128, (1, 10), generator=torch.Generator().manual_seed(0))
    features = target.prefill(tokens)
    assert keys and set(keys) == {10}
    keys.clear()
    target.forward_tree(tokens[:, :3], torch.arange(3).view(1, 3), torch.ones(1, 3, 3, dtype=torch.bool).tril())
    assert set(keys) == {target.cache.max_len}
    keys.clear()
    head = EagleHead(HeadConfig.for_target(target.config)).eval()
    drafter = EagleDrafter(head, target)
    drafter.allocate(256, TreeConfig(total_tokens=8, depth=3, top_k=2))
    drafter.prefill(torch.cat([tokens, tokens[:, :1]], 1), features)
    assert keys == [10]


def test_a_failed_capture_says_where_the_wrapped_error_was_raised():
    """decode.failure: the wrapper's first line, and the innermost wrapped exception's type, file and line
    (inductor wraps its assertions, which often have no message), through ``__cause__`` or
    ``inner_exception``."""
    from fsd_eagle.decode import failure

    class Wrapped(RuntimeError):
        def __init__(self, inner):
            super().__init__("backend compiler failed\nmore lines")
            self.inner_exception = inner

    def check():
        assert 1 + 1 == 3

    for chain in ("cause", "inner"):
        try:
            try:
                check()
            except AssertionError as e:
                if chain == "cause":
                    raise RuntimeError("backend compiler failed") from e
                raise Wrapped(e) from None
        except RuntimeError as e:
            line = check.__code__.co_firstlineno + 1
            assert failure(e) == f"backend compiler failed (AssertionError at test_engine.py:{line})"


def test_a_failed_capture_names_the_compile_workers_error():
    """decode.failure on inductor's SubprocException (a kernel that failed to compile in a compile worker):
    the worker's error, the line naming it and the last line of a message over several lines, on one line."""
    from torch._inductor.compile_worker.subproc_pool import SubprocException

    from fsd_eagle.decode import failure, worker_error

    details = ("Traceback (most recent call last):\n"
               '  File "worker.py", line 3, in run\n'
               "    compile(kernel)\n"
               "triton.compiler.errors.CompilationError: at 7:12:\n"
               "    x = tl.load(ptr + offs)\n"
               "            ^\n"
               "ValueError('arange's range must be a power of 2')\n")
    try:
        try:
            raise SubprocException(details)
        except SubprocException as e:
            raise RuntimeError("backend compiler failed") from e
    except RuntimeError as e:
        text = failure(e)
    assert "\n" not in text
    assert text.startswith("backend compiler failed (SubprocException at test_engine.py:")
    assert text.endswith("in the worker: triton.compiler.errors.CompilationError: at 7:12: ... "
                         "ValueError('arange's range must be a power of 2'))")
    assert worker_error("Traceback (most recent call last):\n  File \"a\", line 1\nKeyError: 'x'\n") == "KeyError: 'x'"
    assert len(worker_error("E: " + "y" * 1000)) == 400


def _graph_signature(gm) -> tuple:
    """What makes two dynamo graphs the same compilation: their code and their inputs' (symbolic) sizes."""
    inputs = [n.meta.get("example_value") for n in gm.graph.nodes if n.op == "placeholder"]
    sizes = tuple(tuple(str(s) for s in v.shape) if isinstance(v, torch.Tensor) else str(v) for v in inputs)
    return gm.code, sizes


@pytest.mark.filterwarnings("ignore:.*flex_attention.*")
def test_a_compilation_does_not_depend_on_what_the_process_compiled_before(tiny_llama, monkeypatch):
    """A GPU Session's compiled prefill and round are the same graphs whatever the process compiled before
    (AR, another rule form, another tree): sizes are symbolic only where the code marks them
    (batch rows, the prefill's padded length), never because an earlier compilation of the same function
    saw other sizes (dynamo's automatic dynamic shapes). So kernels compiled by one process (a warm-up, a
    cache file of ``FSD_EAGLE_COMPILE_CACHE``) serve any other process that runs the same plan."""
    graphs: list[tuple] = []

    def recording(fn):
        def backend(gm, example_inputs):
            graphs.append((fn.__name__, _graph_signature(gm)))
            return gm.forward
        return backend

    gpu_session_on_the_cpu(monkeypatch, recording)
    eng = _engine("eagle", copy.deepcopy(tiny_llama))
    big, small = TreeConfig(total_tokens=12, depth=4, top_k=3), TreeConfig(total_tokens=6, depth=3, top_k=2)
    sampled = AcceptanceRule(SamplingConfig(temperature=0.8))

    def compile_plans(plans) -> dict:
        """Run each (name, tree, rule, drafting, batch) plan as a GPU Session would (prefills of two prompt
        lengths, a captured round), from a fresh dynamo state as a new process starts; the graphs of each."""
        torch._dynamo.reset()
        compiled_prefill.cache_clear()
        compiled_round.cache_clear()
        out = {}
        for name, cfg, rule, drafting, batch in plans:
            rule = rule or GREEDY
            start = len(graphs)
            session = make_session(tree=cfg, rule=rule, engine=eng, graphs=True, compile=True, batch=batch,
                                   drafting=drafting)
            session.use_graph, session.compile, session.attention = True, True, "sdpa"
            session.allocate(512)
            rows = min(batch, 2)
            for length in (40, 100):  # two prefill buckets (64 and 128 tokens)
                ps = [random_prompt(i, 128, length, length) for i in range(rows)]
                session.start_rows(list(range(rows)), ps, [rule] * rows, list(range(rows)))
            assert session._capture_round() is not None
            out[name] = graphs[start:]
        return out

    try:
        alone = compile_plans([("sampled b4 small", small, sampled, True, 4)])
        mixed = compile_plans([("ar b4", big, None, False, 4), ("e2 b4", big, None, True, 4),
                               ("sampled b4 small", small, sampled, True, 4)])
    finally:
        compiled_prefill.cache_clear()
        compiled_round.cache_clear()
        torch._dynamo.reset()
    for name in alone:
        assert [fn for fn, _ in alone[name]] == ["prefill", "run_round"], name  # both buckets: one prefill graph
        assert set(alone[name]) <= {g for plan in mixed.values() for g in plan}, name

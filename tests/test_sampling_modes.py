"""Sampling in every execution mode: the counter-based random stream (fsd_eagle.rng), rule numbers as
inputs of one graph per rule form, lossless sampling (chi-square tests that fail for broken rules) through
eager, compiled, CUDA-graph and compiled + graph rounds, seeds that reproduce across calls, modes and
processes, and FlexAttention never running uncompiled.

CUDA-only modes are skipped without a GPU; compiled modes need a C++ compiler on the CPU."""

from __future__ import annotations

import copy
import importlib.util
import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch._inductor.config
from hypothesis import given, settings
from hypothesis import strategies as st

import fsd_eagle.kernels as kernels_module
import fsd_eagle.tree as tree_module
import fsd_eagle.verify as verify_module
from fsd_eagle.api import SpeculativeGenerator
from fsd_eagle.config import FuzzyConfig, SamplingConfig, TreeConfig
from fsd_eagle.decode import RoundResult, compiled_prefill, compiled_round, prefill_bucket, run_round
from fsd_eagle.engine import Engine
from fsd_eagle.errors import ConfigError
from fsd_eagle.rng import DRAW_ACCEPT, RandomStream, mix32
from fsd_eagle.sampling import RuleForm, process_logits
from fsd_eagle.schedule import decode
from fsd_eagle.session import PendingRound, Plan, Session
from fsd_eagle.tree import draft_tree
from fsd_eagle.verify import AcceptanceRule, sampled_children_walk, verify_tree

from conftest import (CHI_ROWS, chi_square_pvalue, cpu_kernels, decode_all, has_cpu_compiler, make_session,
                      sample_pairs_on, tiny_model)
from test_engine import (BROKEN, STAT_TREE, PathDrafter, Row, _target_logits_for, exact_pair_distribution,
                         make_stat_setup, noisy_copy)

CUDA = torch.cuda.is_available()
needs_cuda = pytest.mark.skipif(not CUDA, reason="CUDA graphs need a GPU")
needs_compiler = pytest.mark.skipif(not has_cpu_compiler(), reason="torch.compile on the CPU needs g++ and Python headers")


# ------------------------------------------------------------------------------ 1. the random stream


def _lowbias32(x: int) -> int:
    """The reference hash in plain 32-bit arithmetic."""
    x ^= x >> 16
    x = (x * 0x7FEB352D) & 0xFFFFFFFF
    x ^= x >> 15
    x = (x * 0x846CA68B) & 0xFFFFFFFF
    return x ^ (x >> 16)


def test_mix32_is_lowbias32_without_overflow():
    xs = [0, 1, 2, 0xFFFF, 0x10000, 0x7FFFFFFF, 0x80000000, 0xFFFFFFFF] + [(i * 2654435761) & 0xFFFFFFFF for i in range(200)]
    assert mix32(torch.tensor(xs)).tolist() == [_lowbias32(x) for x in xs]
    assert [mix32(x) for x in xs] == [_lowbias32(x) for x in xs]


def test_random_stream_is_a_function_of_seed_step_and_draw():
    a, b = RandomStream.create("cpu", 7), RandomStream.create("cpu", 7)
    first = a.uniform((1000,), 0)
    assert torch.equal(first, b.uniform((1000,), 0))
    assert not torch.equal(first, a.uniform((1000,), 1))  # another draw of the same step
    a.advance()
    assert not torch.equal(first, a.uniform((1000,), 0))  # the next step
    assert not torch.equal(first, RandomStream.create("cpu", 8).uniform((1000,), 0))  # another seed
    assert not torch.equal(first, RandomStream.create("cpu", 7 + (1 << 32)).uniform((1000,), 0))  # high bits count
    a.reseed(7)
    assert int(a.counter) == 0 and torch.equal(first, a.uniform((1000,), 0))
    assert torch.equal(RandomStream.create("cpu", -1).key, RandomStream.create("cpu", (1 << 64) - 1).key)


def test_uniforms_are_uniform_and_independent():
    """Goodness of fit of 200k uniforms (100 bins) and of pairs from consecutive steps and from two draws
    of one step (10 x 10 bins): all pass a chi-square test at 1e-3."""
    s = RandomStream.create("cpu", 123)
    u = s.uniform((200_000,), 0)[0]  # the stream's one batch row
    assert 0 < float(u.min()) and float(u.max()) < 1
    other_draw = s.uniform((200_000,), 1)[0]
    s.advance()
    next_step = s.uniform((200_000,), 0)[0]

    def pvalue(counts: torch.Tensor) -> float:
        expected = counts.sum() / counts.numel()
        stat = ((counts - expected) ** 2 / expected).sum().double()
        return float(torch.special.gammaincc(torch.tensor((counts.numel() - 1) / 2, dtype=torch.float64), stat / 2))

    assert pvalue(torch.histc(u, 100, 0, 1)) > 1e-3
    for v in (other_draw, next_step):
        cells = (u * 10).long() * 10 + (v * 10).long()
        assert pvalue(torch.bincount(cells, minlength=100).float()) > 1e-3


@needs_cuda
def test_random_stream_gives_the_same_numbers_on_cuda():
    cpu, gpu = RandomStream.create("cpu", 99), RandomStream.create("cuda", 99)
    for _ in range(3):
        assert torch.equal(cpu.bits((4, 1000), DRAW_ACCEPT), gpu.bits((4, 1000), DRAW_ACCEPT).cpu())
        cpu.advance()
        gpu.advance()


# ----------------------------------------------------------------- 2. rule numbers are graph inputs


def _reference_filter(logits: torch.Tensor, temperature: float, top_k: int, top_p: float) -> torch.Tensor:
    """Temperature, then top-k (ties with the k-th kept), then top-p on what top-k kept, row by row."""
    out = logits / temperature
    if 0 < top_k < out.shape[-1]:
        kth = out.topk(top_k, dim=-1).values[..., -1:]
        out = out.masked_fill(out < kth, float("-inf"))
    if top_p < 1.0:
        rows = []
        for row in out:
            order = row.argsort(descending=True)
            p = row[order].softmax(-1)
            drop = (p.cumsum(-1) - p) >= top_p
            rows.append(row.clone().index_put_((order[drop],), torch.tensor(float("-inf"))))
        out = torch.stack(rows)
    return out


@pytest.mark.parametrize("temperature,top_k,top_p", [(0.7, 0, 0.9), (1.0, 3, 1.0), (1.3, 5, 0.8), (0.5, 40, 0.5),
                                                     (1.0, 0, 1.0)])
def test_process_logits_with_values_as_tensors(temperature, top_k, top_p):
    g = torch.Generator().manual_seed(top_k)
    logits = torch.randn(6, 32, generator=g)
    logits[0, :4] = 2.0  # ties at the top
    logits[1, 5:9] = logits[1].max()  # ties around the k-th
    rule = AcceptanceRule(SamplingConfig(temperature=temperature, top_k=top_k, top_p=top_p))
    got = process_logits(logits, rule.form, rule.values())
    assert torch.equal(torch.isinf(got), torch.isinf(_reference_filter(logits, temperature, top_k, top_p)))
    torch.testing.assert_close(got.softmax(-1), _reference_filter(logits, temperature, top_k, top_p).softmax(-1))


def test_one_session_serves_every_value_of_a_form(monkeypatch, tiny_llama):
    """Calls that differ in temperature, top-p, top-k, threshold or seed share a session (and so, on a GPU,
    one captured or compiled round); greedy, filtered and fuzzy forms get their own."""
    built = []
    init = Session.__init__
    monkeypatch.setattr(Session, "__init__", lambda self, engine, plan: built.append(plan.form) or init(self, engine, plan))
    gen = SpeculativeGenerator(tiny_llama, _Tok(), draft_model=noisy_copy(tiny_llama, 0.1), tree=TreeConfig(6, 2, 2))
    prompt = list(range(3, 12))
    for t in (0.7, 1.0, 1.6):
        gen.generate(prompt, 4, temperature=t, seed=int(10 * t), chat=False)
    gen.generate(prompt, 4, temperature=0.9, top_p=0.8, chat=False)
    gen.generate(prompt, 4, temperature=0.9, top_p=0.5, top_k=3, chat=False)
    for threshold in (0.5, 2.0):
        gen.generate(prompt, 4, temperature=0.9, fuzzy=FuzzyConfig(threshold=threshold), chat=False)
    gen.generate(prompt, 4, chat=False)
    assert built == [RuleForm(greedy=False), RuleForm(greedy=False, filtered=True),
                     RuleForm(greedy=False, fuzzy=True), RuleForm()]


def test_session_is_the_session_generate_uses(tiny_llama):
    gen = SpeculativeGenerator(tiny_llama, _Tok(), draft_model=noisy_copy(tiny_llama, 0.1), tree=TreeConfig(6, 2, 2))
    r = gen.generate(list(range(3, 12)), 4, temperature=0.8, chat=False)
    session = gen.session(temperature=0.3)  # another value of the same form
    assert session is gen.session(temperature=0.8) and session.form == RuleForm(greedy=False)
    assert session.mode == r.stats.mode and session.drafter is not None
    assert gen.session(autoregressive=True).drafter is None


# ------------------------------------------------- 3. lossless sampling through every execution mode


class CompiledSession(Session):
    """Compiled prefills and rounds (decode.compiled_prefill / compiled_round: what GPU sessions capture),
    run without CUDA graphs, so that the CPU checks the compiled code of every rule; prompts padded to
    their length bucket as in graph mode.

    They compile to scalar C++ kernels (conftest.cpu_kernels) and attend with SDPA."""

    def prompt_slots(self, prompt_len: int) -> int:
        return prefill_bucket(prompt_len)

    def _prefill(self, pre, prompts):
        rows, dev = pre.rows, prompts[0].device
        ids = torch.zeros(rows, prefill_bucket(max(p.shape[0] for p in prompts)), dtype=torch.long, device=dev)
        for j, p in enumerate(prompts):
            ids[j, :p.shape[0]] = p
        length = torch.tensor([p.shape[0] for p in prompts] + [1] * (rows - len(prompts)), device=dev)
        st = pre.state
        with torch._inductor.config.patch(cpu_kernels()):
            return compiled_prefill()(pre.target, pre.drafter, ids, length, self.form.exact(), st.values, st.rng)

    def launch(self):
        # Static shapes whatever the rows (as one-row GPU sessions compile): a symbolic batch size (what
        # batched GPU sessions compile, tests/test_batch.py) took several times longer to compile here.
        assert self.target.attention == "sdpa"
        with torch._inductor.config.patch(cpu_kernels()):
            return PendingRound(compiled_round()(self.target, self.drafter, self.state, self.tree, self.form).cpu())


MODES = {
    "eager": pytest.param("eager"),
    "compiled": pytest.param("compiled", marks=needs_compiler),
    "graph": pytest.param("graph", marks=needs_cuda),
    "compiled_graph": pytest.param("compiled_graph", marks=needs_cuda),
}


def broken_cases(broken: dict) -> list:
    """(mode, broken) pairs: each broken rule of ``broken`` in every mode, except the CPU-compiled mode, which
    takes the first one only. That the chi-square test detects each kind of breakage is shown eagerly (and on
    a GPU in every mode); compiled, one broken rule shows that a compiled round runs the rule's code as patched
    (a round that kept an earlier compilation would pass it), and each compilation costs about a minute on two
    cores."""
    first = sorted(broken)[0]
    return [pytest.param(mode.values[0], name, marks=mode.marks, id=f"{mode.values[0]}-{name}")
            for name in sorted(broken) for mode in MODES.values() if mode.values[0] != "compiled" or name == first]


def value_cases() -> list:
    """(mode, temperature, top_p) triples for the chi-square tests of the exact rules: T = 1 without a filter
    (the rule a temperature alone gives) and T = 0.7 with top-p 0.9 (a filtered form: other code) in every
    mode, except the CPU-compiled mode, which takes the first only. That a compiled round of a filtered form
    makes the eager round's choices is test_compiled_sampling_rounds_equal_eager_ones (exactly, round after
    round); on a GPU every pair runs in every mode; each compilation costs about a minute on two cores."""
    return [pytest.param(mode.values[0], temperature, top_p, marks=mode.marks,
                         id=f"{temperature}-{top_p}-{mode.values[0]}")
            for temperature, top_p in [(1.0, 1.0), (0.7, 0.9)] for mode in MODES.values()
            if mode.values[0] != "compiled" or temperature == 1.0]


def ran_as(mode: str) -> str:
    """The ``Session.mode`` a test's execution mode must still show after decoding: a round that could not be
    compiled or captured falls back to uncompiled graph rounds (or eager ones), which would test the rule
    through another path than the one named. (The CPU's compiled mode is a CompiledSession: no fallback, an
    error.)"""
    return {"compiled": "eager", "compiled_graph": "compiled"}.get(mode, mode)


def make_mode_session(mode: str, engine, tree, form, batch: int = CHI_ROWS) -> Session:
    """A session of ``batch`` rows (default: the chi-square tests' CHI_ROWS) running ``mode``."""
    if mode == "compiled":
        return CompiledSession(engine, Plan(tree, form, batch=batch))
    return Session(engine, Plan(tree, form, graphs=mode != "eager", compile=mode == "compiled_graph", batch=batch))


def stat_setup_on(device: str):
    model, engine, prompt, first, second = make_stat_setup()
    engine = Engine(model.to(device), None, draft_model=engine.draft_model.to(device))
    return engine, prompt.to(device), first, second


@pytest.mark.parametrize("mode,temperature,top_p", value_cases())
def test_sampling_is_lossless_in_every_mode(mode, temperature, top_p):
    torch._dynamo.reset()
    device = "cuda" if mode in ("graph", "compiled_graph") else "cpu"
    engine, prompt, first, second = stat_setup_on(device)
    rule = AcceptanceRule(SamplingConfig(temperature=temperature, top_p=top_p))
    session = make_mode_session(mode, engine, STAT_TREE, rule.form)
    n = 2000
    counts, accept_rate = sample_pairs_on(session, prompt, rule, n, seed=5)
    assert session.mode == ran_as(mode)
    assert accept_rate > 0.3
    expected = exact_pair_distribution(first.to("cpu"), second.to("cpu"), temperature, top_p)
    assert chi_square_pvalue(counts, expected, n) > 1e-3


SAMPLED_TREE = TreeConfig(total_tokens=6, depth=2, top_k=3)  # two levels: the walk goes past the first


def _keep_residual(monkeypatch):
    """Sampled children: after a rejection keep p instead of max(p - r, 0) renormalised (in the torch sums:
    on CUDA the rejection-states kernel, which test_rejection_states_kernel_equals_the_torch_sums checks, is
    turned off)."""
    monkeypatch.setattr(verify_module, "_residual_coefficient", lambda coef, mass, r_mass: coef)
    monkeypatch.setattr(kernels_module, "fits_rejection_states", lambda p, slots: False)


BROKEN_SAMPLED = {"double_acceptance": BROKEN["double_acceptance"], "keep_residual": _keep_residual}


@pytest.mark.parametrize("mode,temperature,top_p", value_cases())
def test_sampled_children_are_lossless_in_every_mode(mode, temperature, top_p):
    """Children drawn from the draft (without replacement) and verified by recursive rejection sampling
    without replacement: the target's distribution through every execution mode, and (the point of them)
    accepted more often than the draft's top children when the draft is close to the target."""
    torch._dynamo.reset()
    device = "cuda" if mode in ("graph", "compiled_graph") else "cpu"
    engine, prompt, first, second = stat_setup_on(device)
    rule = AcceptanceRule(SamplingConfig(temperature=temperature, top_p=top_p, children="sampled"))
    assert rule.form.sampled_children
    session = make_mode_session(mode, engine, SAMPLED_TREE, rule.form)
    n = 2000
    counts, accept_rate = sample_pairs_on(session, prompt, rule, n, seed=5)
    assert session.mode == ran_as(mode)
    expected = exact_pair_distribution(first.to("cpu"), second.to("cpu"), temperature, top_p)
    assert chi_square_pvalue(counts, expected, n) > 1e-3
    if temperature == 1.0 and mode == "eager":
        top = AcceptanceRule(SamplingConfig(temperature=temperature, top_p=top_p))
        _, top_rate = sample_pairs_on(make_mode_session(mode, engine, SAMPLED_TREE, top.form), prompt, top, n, 5)
        assert accept_rate > top_rate + 0.1, (accept_rate, top_rate)


@pytest.mark.parametrize("mode,broken", broken_cases(BROKEN_SAMPLED))
def test_the_sampling_test_fails_broken_sampled_children(monkeypatch, mode, broken):
    BROKEN_SAMPLED[broken](monkeypatch)
    torch._dynamo.reset()
    device = "cuda" if mode in ("graph", "compiled_graph") else "cpu"
    engine, prompt, first, second = stat_setup_on(device)
    rule = AcceptanceRule(SamplingConfig(temperature=1.0, children="sampled"))
    session = make_mode_session(mode, engine, SAMPLED_TREE, rule.form)
    n = 600
    counts, _ = sample_pairs_on(session, prompt, rule, n, seed=5)
    assert session.mode == ran_as(mode)
    torch._dynamo.reset()
    assert chi_square_pvalue(counts, exact_pair_distribution(first.cpu(), second.cpu(), 1.0, 1.0), n) < 1e-3


POOL_TREE = TreeConfig(total_tokens=6, depth=2, top_k=3, pool=4)  # children from each node's 4 likeliest drafts


def _drop_outside_mass(monkeypatch):
    """Children from a pool: forget the target's mass outside the pool (the rejection sums then miss it)."""
    proposal = verify_module._proposal_at_nodes

    def without_outside(*args):
        r, p_d, outside, cols, support = proposal(*args)
        return r, p_d, 0.0, cols, support

    monkeypatch.setattr(verify_module, "_proposal_at_nodes", without_outside)


def _proposal_not_truncated(monkeypatch):
    """Children from a pool, verified as if drawn from a distribution with more mass outside the pool: r
    halved on the pool (as if half the draft's mass lay elsewhere), not the distribution the children came
    from."""
    proposal = verify_module._proposal_at_nodes

    def untruncated(tree, probs, temperature, x):
        r, p_d, outside, cols, support = proposal(tree, probs, temperature, x)
        return r * 0.5, p_d, outside, cols, support

    monkeypatch.setattr(verify_module, "_proposal_at_nodes", untruncated)


def _drawn_colder(monkeypatch):
    """Children from a pool drawn at a quarter of the call's temperature (nearly the pool's top k, in order;
    on CUDA in kernels.pool_draw, elsewhere with torch ops) while the verifier takes them as drawn at the
    call's temperature: the draws are not what the proposal says."""
    draw = tree_module._pool_children

    def colder(logits, k, pool, vocab, temperature, *rest):
        return draw(logits, k, pool, vocab, temperature * 0.25, *rest)

    monkeypatch.setattr(tree_module, "_pool_children", colder)


BROKEN_POOL = {"keep_residual": _keep_residual, "drop_outside_mass": _drop_outside_mass,
               "proposal_not_truncated": _proposal_not_truncated, "drawn_colder": _drawn_colder}


@pytest.mark.parametrize("mode", MODES.values())
def test_children_from_a_pool_are_lossless_in_every_mode(mode):
    """Children drawn from each node's pool (its top 4 of STAT_VOCAB draft tokens) and verified by recursive
    rejection sampling without replacement over the pool: the target's distribution through every
    execution mode."""
    torch._dynamo.reset()
    device = "cuda" if mode in ("graph", "compiled_graph") else "cpu"
    engine, prompt, first, second = stat_setup_on(device)
    rule = AcceptanceRule(SamplingConfig(temperature=0.7, top_p=0.9, children="sampled"))
    session = make_mode_session(mode, engine, POOL_TREE, rule.form)
    n = 2000
    counts, accept_rate = sample_pairs_on(session, prompt, rule, n, seed=5)
    assert session.mode == ran_as(mode)
    assert accept_rate > 0.3
    assert chi_square_pvalue(counts, exact_pair_distribution(first.cpu(), second.cpu(), 0.7, 0.9), n) > 1e-3


@pytest.mark.parametrize("mode,broken", broken_cases(BROKEN_POOL))
def test_the_sampling_test_fails_broken_pool_children(monkeypatch, mode, broken):
    BROKEN_POOL[broken](monkeypatch)
    torch._dynamo.reset()
    device = "cuda" if mode in ("graph", "compiled_graph") else "cpu"
    engine, prompt, first, second = stat_setup_on(device)
    rule = AcceptanceRule(SamplingConfig(temperature=1.0, children="sampled"))
    session = make_mode_session(mode, engine, POOL_TREE, rule.form)
    n = 600
    counts, _ = sample_pairs_on(session, prompt, rule, n, seed=5)
    assert session.mode == ran_as(mode)
    torch._dynamo.reset()
    assert chi_square_pvalue(counts, exact_pair_distribution(first.cpu(), second.cpu(), 1.0, 1.0), n) < 1e-3


def _rewritten_each_rejection(p, r, x, slots_there):
    """The definition, one row: before each child, p(x) and r(x) of the current distributions; after a
    rejection p = max(p - r, 0) renormalised and r without x, renormalised. Returns them and the last p."""
    p, r, seen = p.clone(), r.clone(), []
    for token in x[:slots_there].tolist():
        seen.append((float(p[token]), float(r[token])))
        p = (p - r).clamp(min=0)
        p = p / p.sum()
        r[token] = 0.0
        r = r / r.sum()
    return seen, p


@pytest.mark.parametrize("seed", range(4))
def test_rejections_follow_one_coefficient(seed):
    """Recursive rejection without replacement keeps p as max(p_0 - coef * r_0, 0) off the rejected tokens:
    the distributions it gives before every child and after the last equal rewriting p and r after each
    rejection (which is what the definition says); the draft vocabulary leaves r zero on most tokens."""
    gen = torch.Generator().manual_seed(seed)
    vocab, slots = 40, 5
    p = (torch.randn(2, vocab, generator=gen) * 2).softmax(-1)
    r = (torch.randn(2, vocab, generator=gen) * 2).softmax(-1) * (torch.rand(2, vocab, generator=gen) < 0.6)
    r = r / r.sum(1, keepdim=True)
    x = torch.stack([torch.multinomial(r[i], slots, generator=gen) for i in range(2)])
    there = [5, 3]
    exists = torch.arange(slots) < torch.tensor(there).unsqueeze(1)
    px, rx = p.gather(1, x), r.gather(1, x)
    coef, mass, r_mass, kept = verify_module._rejection_states(p, r, px, rx, exists)
    last = verify_module._residual_after_all(p, r, x, px, rx, exists, coef[:, -1:], mass[:, -1:], kept)
    for i in range(2):
        seen, p_last = _rewritten_each_rejection(p[i], r[i], x[i], there[i])
        for j, (p_j, r_j) in enumerate(seen):
            p_x = float((px[i, j] - coef[i, j] * rx[i, j]).clamp(min=0) / mass[i, j])
            assert p_x == pytest.approx(p_j, abs=1e-6) and float(rx[i, j] / r_mass[i, j]) == pytest.approx(r_j, abs=1e-6)
        assert torch.allclose(last[i], p_last, atol=1e-6)


@pytest.mark.skipif(not CUDA or importlib.util.find_spec("triton") is None,
                    reason="the rejection-states kernel runs on CUDA with Triton")
@pytest.mark.parametrize("compiled", [False, True])
@pytest.mark.parametrize("lead,size,slots", [((2, 61), 32, 8), ((1, 64), 32, 8), ((3,), 4, 3), ((2, 5), 1024, 10)])
def test_rejection_states_kernel_equals_the_torch_sums(lead, size, slots, compiled):
    """On CUDA, _rejection_states over a pool runs kernels.rejection_states (one Triton kernel; in a compiled
    function too, where inductor fused the torch sums into a kernel that Triton could not compile): the
    torch sums' states (computed on the CPU) to float32 rounding, for children that fill a prefix of the
    slots (none to all), with and without target mass outside the pool."""
    gen = torch.Generator().manual_seed(size + slots)
    r = (torch.randn(*lead, size, generator=gen) * 2).softmax(-1)
    flat = r.reshape(-1, size)
    x = torch.stack([torch.multinomial(flat[i], slots, generator=gen) for i in range(flat.shape[0])]).view(*lead, slots)
    exists = torch.arange(slots) < torch.randint(0, slots + 1, (*lead, 1), generator=gen)
    states = verify_module._rejection_states
    fn = torch.compile(states, fullgraph=True) if compiled else states
    assert kernels_module.fits_rejection_states(r.cuda(), slots)
    for outside in (0.0, 0.2 * torch.rand(lead, generator=gen)):
        p = (torch.randn(*lead, size, generator=gen) * 2).softmax(-1) * (1 - outside.unsqueeze(-1) if torch.is_tensor(outside) else 1)
        px, rx = p.gather(-1, x), r.gather(-1, x)
        want = states(p, r, px, rx, exists, outside)
        got = fn(*(t.cuda() for t in (p, r, px, rx, exists)), outside.cuda() if torch.is_tensor(outside) else outside)
        for name, a, b in zip(("coef", "mass", "r_mass", "kept"), got, want):
            assert a.shape == b.shape, name
            torch.testing.assert_close(a.cpu(), b, rtol=1e-5, atol=1e-6, msg=name)


def _sampled_tree(shape, subset: bool, temperature: float, seed: int, pool: int = 0):
    """Two rows' trees with children sampled from a PathDrafter (over a draft vocabulary with ``subset``;
    from each node's ``pool`` most likely draft tokens when set), the target's logits ``[2, n, V]`` and the
    rows' random stream at the step the tree was drawn with."""
    total, depth, k, n_vocab, _ = shape
    cfg = TreeConfig(total_tokens=total, depth=depth, top_k=k, pool=pool)
    vocab = torch.randperm(n_vocab, generator=torch.Generator().manual_seed(seed))[: max(k, n_vocab // 2)]
    drafter = PathDrafter(n_vocab, cfg, seed, vocab=vocab if subset else None)
    roots = [seed % n_vocab, (seed * 7 + 3) % n_vocab]
    rng = RandomStream.create("cpu", seed, batch=2)
    rng.reseed(seed + 1, 1)
    root_logits, root_state = drafter.root(roots)
    tree = draft_tree(drafter, torch.tensor(roots), root_logits, root_state, cfg, with_q=True, rng=rng,
                      temperature=torch.full((2,), temperature))
    logits = torch.stack([_target_logits_for(Row(tree, b), n_vocab, seed + b, 0.4) for b in range(2)])
    return tree, logits, rng


def _reference_sampled_walk(tree, probs, fuzzy: bool, pure: bool, temperature: float, uniforms, b: int):
    """Row ``b`` under recursive rejection sampling without replacement, written from the definition: walk
    down from the root; at each node rewrite p and r after every rejected child (p = max(p - r, 0)
    renormalised, r without the child's token, renormalised); the fuzzy rule at T = inf takes the first
    child drawn. Returns the accepted nodes and the bonus distribution."""
    parents, tokens, q_row = tree.parents[b].tolist(), tree.tokens[b].tolist(), tree.q_row[b].tolist()
    cur, path = 0, [0]
    for level in range(tree.max_depth):
        kids = [c for c in range(1, tree.size) if parents[c] == cur]
        if not kids:
            break
        p = probs[b, cur].clone()
        r_d = (tree.r_logits[b, q_row[cur]].float() / temperature).softmax(-1)
        if tree.r_tokens is not None:
            r = torch.zeros_like(p).index_copy(0, tree.r_tokens[b, q_row[cur]], r_d)
        else:
            r = r_d if tree.r_vocab is None else torch.zeros_like(p).index_copy(0, tree.r_vocab, r_d)
        taken = None
        for slot, child in enumerate(kids):
            x = tokens[child]
            if float(uniforms[b, level, slot]) < float(p[x] / r[x]):
                taken = child
                break
            p = (p - r).clamp(min=0)
            p = p / p.sum()
            r[x] = 0.0
            r = r / r.sum()
        if pure or taken is None:
            taken = kids[0] if fuzzy else None
        if taken is None:
            return path, (probs[b, cur] if pure else p)
        cur = taken
        path.append(cur)
    return path, probs[b, cur]


@settings(max_examples=40, deadline=None)
@given(shape=st.tuples(st.integers(2, 60), st.integers(1, 5), st.integers(1, 5), st.integers(8, 40), st.integers(0, 10_000)),
       subset=st.booleans(), temperature=st.sampled_from([0.6, 1.0]), top_p=st.sampled_from([0.8, 1.0]),
       fuzzy=st.sampled_from(["exact", "hybrid", "pure"]), pool_extra=st.sampled_from([None, 0, 1, 3]))
def test_sampled_children_verdicts_follow_the_definition(shape, subset, temperature, top_p, fuzzy, pool_extra):
    """sampled_children_walk makes every node's tests at once and then walks; a walk that rewrites p and r
    after each rejection (the definition) accepts the same nodes and ends with the same bonus distribution,
    row by row, with and without a draft vocabulary (its ids in no order), with children from the whole
    draft vocabulary or from a pool of each node's top k + ``pool_extra`` draft tokens, for the exact rule and
    for both fuzzy modes at T = inf (which take the first child drawn)."""
    pool = 0 if pool_extra is None else shape[2] + pool_extra
    tree, logits, rng = _sampled_tree(shape, subset, temperature, shape[4], pool)
    assert (tree.r_tokens is not None) == (pool > 0)
    sampling = SamplingConfig(temperature=temperature, top_p=top_p, children="sampled")
    rule = AcceptanceRule(sampling) if fuzzy == "exact" else \
        AcceptanceRule(sampling, FuzzyConfig(threshold=float("inf"), mode=fuzzy))
    form, values = rule.form, rule.values()
    probs = process_logits(logits, form, values).softmax(-1)
    uniforms = rng.uniform((tree.max_depth, tree.max_children), DRAW_ACCEPT)
    fuzzy_ok = torch.ones(tree.tokens.shape, dtype=torch.bool) if form.fuzzy else torch.zeros(tree.tokens.shape, dtype=torch.bool)
    end, n_acc, exact_len, p_end = sampled_children_walk(tree, probs, fuzzy_ok, fuzzy == "pure",
                                                         values.temperature.expand(2), uniforms)
    verdict = verify_tree(tree, logits, form, values, rng)
    for b in range(2):
        path, p_ref = _reference_sampled_walk(tree, probs, form.fuzzy, fuzzy == "pure", temperature, uniforms, b)
        assert int(n_acc[b]) == len(path) and int(end[b]) == path[-1]
        torch.testing.assert_close(p_end[b] / p_end[b].sum(), p_ref / p_ref.sum(), atol=1e-5, rtol=1e-4)
        assert verdict.path[b, : len(path)].tolist() == path  # verify_tree takes the same walk
        if fuzzy == "exact":
            assert int(exact_len[b]) == len(path)


def test_sampled_children_settings():
    """children is 'auto', 'top' or 'sampled'; greedy rules ignore it; the fuzzy rule keeps it."""
    with pytest.raises(ConfigError, match="children must be 'auto', 'top' or 'sampled'"):
        SamplingConfig(temperature=0.7, children="random")
    assert not AcceptanceRule(SamplingConfig(children="sampled")).form.sampled_children  # greedy
    form = AcceptanceRule(SamplingConfig(temperature=0.7, children="sampled"), FuzzyConfig(threshold=1.0)).form
    assert form.sampled_children and form.fuzzy


@pytest.mark.parametrize("exec_mode,mode", [("eager", "hybrid"), ("eager", "pure"),
                                            pytest.param("compiled", "hybrid", marks=needs_compiler),
                                            pytest.param("graph", "hybrid", marks=needs_cuda),
                                            pytest.param("compiled_graph", "pure", marks=needs_cuda)])
def test_fuzzy_sampled_children_at_t_inf_sample_the_draft(exec_mode, mode):
    """FSD over a sampled chain (the paper's speculative sampling): at T = inf every drawn child is accepted,
    so the token after the prefill's (a target sample) is distributed as the draft model's own sample, not
    the target's; eager, compiled and in CUDA graphs."""
    torch._dynamo.reset()
    device = "cuda" if exec_mode in ("graph", "compiled_graph") else "cpu"
    _, engine, prompt, first, second = make_stat_setup()
    with torch.no_grad():
        q_second = engine.draft_model(torch.cat([prompt.expand(len(first), -1),
                                                 torch.arange(len(first))[:, None]], 1)).logits[:, -1]
    engine, prompt, _, _ = stat_setup_on(device)
    rule = AcceptanceRule(SamplingConfig(temperature=1.0, children="sampled"),
                          FuzzyConfig(threshold=float("inf"), divergence="kl", mode=mode))
    session = make_mode_session(exec_mode, engine, TreeConfig(total_tokens=3, depth=2, top_k=1), rule.form)
    n = 2000
    counts, accept_rate = sample_pairs_on(session, prompt, rule, n, seed=9)
    assert session.mode == ran_as(exec_mode)
    assert accept_rate == 1.0
    assert chi_square_pvalue(counts, exact_pair_distribution(first, q_second, 1.0, 1.0), n) > 1e-3
    assert chi_square_pvalue(counts, exact_pair_distribution(first, second, 1.0, 1.0), n) < 1e-3


def test_fuzzy_sampled_children_at_t0_decode_as_the_exact_rule():
    """Hybrid FSD at T = 0 over sampled children decodes exactly what the exact rule decodes (same seed):
    the fuzzy test never fires, and it draws no random numbers of its own."""
    target = tiny_model("llama", seed=0)
    draft = noisy_copy(target, 0.05)
    tree = TreeConfig(total_tokens=8, depth=3, top_k=2)
    sampled = SamplingConfig(temperature=0.8, children="sampled")
    prompt = torch.tensor([5, 17, 99, 3, 42, 64, 8, 120])

    def run(rule, seed):
        out, stats = decode_all(make_session(target, tree, rule, draft_model=draft), prompt, 20, rule, seed)
        return out, stats.accept_lengths

    exact = run(AcceptanceRule(sampled), 3)
    assert run(AcceptanceRule(sampled), 4)[0] != exact[0]  # the seed matters: equality below is not vacuous
    for fuzzy in (FuzzyConfig(threshold=0.0, divergence="kl"), FuzzyConfig(threshold=1e-12, divergence="js", mode="hybrid")):
        assert run(AcceptanceRule(sampled, fuzzy), 3) == exact, fuzzy


@pytest.mark.parametrize("mode,broken", broken_cases(BROKEN))
def test_the_sampling_test_fails_a_broken_rule_in_every_mode(monkeypatch, mode, broken):
    BROKEN[broken](monkeypatch)
    torch._dynamo.reset()  # compiled rounds must trace the broken rule
    device = "cuda" if mode in ("graph", "compiled_graph") else "cpu"
    engine, prompt, first, second = stat_setup_on(device)
    rule = AcceptanceRule(SamplingConfig(temperature=1.0))
    session = make_mode_session(mode, engine, STAT_TREE, rule.form)
    n = 400
    counts, _ = sample_pairs_on(session, prompt, rule, n, seed=5)
    assert session.mode == ran_as(mode)
    torch._dynamo.reset()  # nothing compiled from the broken rule outlives this test
    assert chi_square_pvalue(counts, exact_pair_distribution(first.cpu(), second.cpu(), 1.0, 1.0), n) < 1e-3


# ------------------------------------------------------------------------- 4. seeds through the API


class _Tok:
    """Token ids only."""

    eos_token_id = None
    chat_template = None

    @staticmethod
    def decode(ids, skip_special_tokens=True):
        return " ".join(map(str, ids))


API_MODES = {
    "eager": pytest.param("eager"),
    "default": pytest.param("default"),
    "graph": pytest.param("graph", marks=needs_cuda),
    "compiled": pytest.param("compiled", marks=needs_cuda),
}


def api_generator(mode: str, model, draft) -> SpeculativeGenerator:
    device = "cuda" if mode in ("graph", "compiled") else "cpu"
    gen = SpeculativeGenerator(model.to(device), _Tok(), draft_model=draft.to(device), tree=TreeConfig(8, 3, 2))
    gen.configure(cuda_graphs=mode != "eager", compile=mode == "compiled")
    return gen


@pytest.mark.parametrize("mode", API_MODES.values())
def test_a_seed_gives_the_same_text_every_call(mode, tiny_llama):
    model = copy.deepcopy(tiny_llama)
    gen = api_generator(mode, model, noisy_copy(model, 0.1))
    prompt = list(range(5, 20))
    for sampling in (dict(temperature=1.0), dict(temperature=0.8, top_p=0.9),
                     dict(temperature=1.0, fuzzy=FuzzyConfig(threshold=0.5, divergence="reverse_kl"))):
        runs = [gen.generate(prompt, 24, seed=seed, chat=False, **sampling).token_ids for seed in (11, 11, 12, 11)]
        assert runs[0] == runs[1] == runs[3], sampling  # a call in between changes nothing
        assert runs[2] != runs[0], sampling
        ar = [gen.generate(prompt, 24, seed=seed, chat=False, autoregressive=True, **sampling).token_ids
              for seed in (11, 11, 12)]
        assert ar[0] == ar[1] != ar[2]


@needs_cuda
def test_graph_rounds_sample_what_eager_rounds_sample(tiny_llama):
    """fp32: the same seed gives the same tokens whether rounds are replayed from a CUDA graph or run eagerly."""
    model = copy.deepcopy(tiny_llama)
    draft = noisy_copy(model, 0.1)
    out = {}
    for mode in ("eager", "graph"):
        gen = api_generator(mode, model, draft)
        out[mode] = [gen.generate(list(range(5, 20)), 32, temperature=1.0, seed=s, chat=False).token_ids for s in range(4)]
    assert out["graph"] == out["eager"]


SUBPROCESS = """
import json, sys, torch
sys.path.insert(0, {tests!r})
from conftest import tiny_model
from test_sampling_modes import _Tok
from test_engine import noisy_copy
from fsd_eagle.api import SpeculativeGenerator
from fsd_eagle.config import TreeConfig
torch.set_num_threads(1)
model = tiny_model("llama")
gen = SpeculativeGenerator(model, _Tok(), draft_model=noisy_copy(model, 0.1), tree=TreeConfig(8, 3, 2))
print(json.dumps(gen.generate(list(range(5, 20)), 24, temperature=0.9, seed=42, chat=False).token_ids))
"""


def test_a_seed_gives_the_same_text_in_another_process():
    model = tiny_model("llama")
    gen = SpeculativeGenerator(model, _Tok(), draft_model=noisy_copy(model, 0.1), tree=TreeConfig(8, 3, 2))
    here = gen.generate(list(range(5, 20)), 24, temperature=0.9, seed=42, chat=False).token_ids
    script = SUBPROCESS.format(tests=str(Path(__file__).parent))
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, check=True, timeout=300)
    assert json.loads(out.stdout.strip().splitlines()[-1]) == here


# ------------------------------------------------------------ 5. FlexAttention only where compiled


def test_no_public_call_runs_flex_attention_uncompiled(monkeypatch, tiny_llama):
    """Every public way to build a session (compile on or off, graphs on or off, each attention choice,
    greedy or sampling, exact or fuzzy, head-less AR or a draft model): FlexAttention runs only inside
    compilation (on a CPU, where the API compiles nothing, never)."""
    import torch.nn.attention.flex_attention as flex_module

    calls = []
    real = flex_module.flex_attention

    def spy(*args, **kwargs):
        calls.append(torch.compiler.is_compiling())
        return real(*args, **kwargs)

    monkeypatch.setattr(flex_module, "flex_attention", spy)
    model = copy.deepcopy(tiny_llama)
    draft = noisy_copy(model, 0.1)
    device = "cuda" if CUDA else "cpu"
    gen = SpeculativeGenerator(model.to(device), _Tok(), draft_model=draft.to(device), tree=TreeConfig(6, 2, 2))
    prompt = list(range(3, 12))
    for compile_ in (False, True):
        for graphs in (False, True):
            for attention in (None, "sdpa", "flex"):
                gen.configure(compile=compile_, cuda_graphs=graphs)
                gen.use_attention(attention)
                for kwargs in ({}, dict(temperature=0.8, seed=1), dict(fuzzy=FuzzyConfig(threshold=1.0)),
                               dict(autoregressive=True, temperature=0.5)):
                    r = gen.generate(prompt, 6, chat=False, **kwargs)
                    assert r.stats.attention == "sdpa" or r.stats.mode == "compiled"
    assert not any(c is False for c in calls), "FlexAttention ran without compilation"
    if not CUDA:
        assert calls == []


@pytest.mark.filterwarnings("ignore:.*flex_attention.*")
@pytest.mark.parametrize("rule", [AcceptanceRule(SamplingConfig(temperature=0.8)),
                                  AcceptanceRule(SamplingConfig(temperature=0.8, top_p=0.9, top_k=5),
                                                 FuzzyConfig(threshold=1.0, divergence="reverse_kl")),
                                  AcceptanceRule(SamplingConfig(temperature=0.8), FuzzyConfig(threshold=1.0, mode="pure")),
                                  AcceptanceRule(SamplingConfig(temperature=0.8, top_p=0.9, children="sampled"))],
                         ids=["exact", "filtered_fuzzy", "pure", "sampled_children"])
def test_a_sampling_round_is_one_graph_for_dynamo(tiny_llama, rule):
    """No graph break in a sampling round (random numbers, filters, fuzzy rules): one compiled graph."""
    torch._dynamo.reset()
    model = copy.deepcopy(tiny_llama)
    cfg = TreeConfig(total_tokens=12, depth=4, top_k=3)
    s = make_session(model, cfg, rule, draft_model=noisy_copy(model, 0.1))
    next(decode(s, torch.arange(3, 12), 2, rule, 0))
    report = torch._dynamo.explain(run_round)(s.target, s.drafter, s.state, cfg, rule.form)
    assert (report.graph_count, report.graph_break_count) == (1, 0), report.break_reasons


@needs_cuda
@pytest.mark.parametrize("rule", [AcceptanceRule(SamplingConfig(temperature=0.8, top_p=0.9)),
                                  AcceptanceRule(SamplingConfig(temperature=0.8), FuzzyConfig(threshold=1.0)),
                                  AcceptanceRule(SamplingConfig(temperature=0.8, children="sampled"))],
                         ids=["exact", "fuzzy", "sampled_children"])
def test_a_sampling_round_has_no_host_sync(tiny_llama, rule):
    model = copy.deepcopy(tiny_llama)
    draft = noisy_copy(model, 0.1).cuda()
    cfg = TreeConfig(total_tokens=12, depth=4, top_k=3)
    s = make_session(model.cuda(), cfg, rule, draft_model=draft)
    next(decode(s, torch.arange(3, 12, device="cuda"), 2, rule, 0))
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        run_round(s.target, s.drafter, s.state, cfg, rule.form)
    finally:
        torch.cuda.set_sync_debug_mode("default")


@needs_compiler
def test_compiled_sampling_rounds_equal_eager_ones(tiny_llama):
    """The compiled round draws the same random numbers and makes the same choices as the eager round
    (fp32, CPU), round after round, for a fuzzy sampling rule with filters. (Inductor's freezing, which fuses
    the matmuls of the target and the draft model, is checked on greedy rounds:
    test_engine.test_compiled_round_equals_the_eager_round.)"""
    torch._dynamo.reset()
    rule = AcceptanceRule(SamplingConfig(temperature=0.8, top_p=0.9), FuzzyConfig(threshold=0.5, divergence="reverse_kl"))
    cfg = TreeConfig(total_tokens=12, depth=4, top_k=3)
    model = copy.deepcopy(tiny_llama)
    results = []
    for fn in (run_round, compiled_round()):
        s = make_session(model, cfg, rule, draft_model=noisy_copy(model, 0.1))
        next(decode(s, torch.arange(3, 12), 2, rule, 3))
        with torch.no_grad(), torch._inductor.config.patch(cpu_kernels()):
            results.append(torch.stack([fn(s.target, s.drafter, s.state, cfg, rule.form)[0] for _ in range(6)]))
    div_sum = RoundResult.FIELDS.index("div_sum")
    others = [i for i in range(results[0].shape[1]) if i != div_sum]
    assert torch.equal(results[0][:, others], results[1][:, others])  # tokens, accepted lengths, counts
    torch.testing.assert_close(results[0][:, div_sum], results[1][:, div_sum], rtol=1e-5, atol=1e-6)  # fused sums
    assert (results[0][:, 0] > 1).any()


def test_sampled_children_through_the_api_and_a_seed(tiny_llama):
    """generate(children="sampled"): a draft model's chain drafts samples; one seed gives the same tokens
    every call, another seed other tokens; a greedy call ignores the setting; a bad value is one line."""
    model = copy.deepcopy(tiny_llama)
    gen = SpeculativeGenerator(model, _Tok(), draft_model=noisy_copy(model, 0.1), tree=TreeConfig(5, 4, 1))
    gen.configure(cuda_graphs=False, compile=False)
    prompt = [3, 9, 27, 4]
    run = lambda seed, children="sampled": gen.generate(prompt, 24, temperature=0.9, seed=seed, chat=False,  # noqa: E731
                                                        children=children).token_ids
    assert run(7) == run(7) and run(7) != run(8)
    assert len(run(7)) > 4
    greedy = gen.generate(prompt, 12, chat=False, children="sampled").token_ids
    assert greedy == gen.generate(prompt, 12, chat=False, autoregressive=True).token_ids
    # plain decoding has no children: the setting changes nothing there
    plain = dict(temperature=0.9, seed=3, chat=False, autoregressive=True)
    assert gen.generate(prompt, 12, children="sampled", **plain).token_ids == gen.generate(prompt, 12, **plain).token_ids
    with pytest.raises(ConfigError, match="children must be"):
        gen.generate(prompt, 4, temperature=0.9, chat=False, children="all")


def test_children_follow_the_tree_unless_named(tiny_llama):
    """children="auto" (the API's default): sampled children where the call's tree draws them from a pool
    (a preset's sampling tree, or set_tree(pool=...)), top children otherwise; "top" and "sampled" as
    named whatever the tree; greedy calls have no children to choose. The decode follows the form: with a
    pool, "auto" gives exactly the tokens of "sampled" for a seed, and not those of "top"."""
    model = copy.deepcopy(tiny_llama)
    gen = SpeculativeGenerator(model, _Tok(), draft_model=noisy_copy(model, 0.3), tree=TreeConfig(8, 3, 2))
    gen.configure(cuda_graphs=False, compile=False)

    def sampled(children: str, temperature: float = 0.8) -> bool:
        return gen.session(temperature=temperature, children=children).form.sampled_children

    assert not sampled("auto") and not sampled("top") and sampled("sampled")
    gen.set_tree(8, 3, 2, pool=4)
    assert sampled("auto") and not sampled("top") and sampled("sampled")
    assert not sampled("auto", temperature=0.0)
    assert gen.session(temperature=0.8).form.sampled_children  # the default is "auto"
    prompt = [3, 9, 27, 4, 81, 5]
    run = lambda children: gen.generate(prompt, 24, temperature=0.9, seed=5, chat=False,  # noqa: E731
                                        children=children).token_ids
    assert run("auto") == run("sampled") and run("auto") != run("top")


@needs_compiler
def test_sampling_is_lossless_on_rounds_loaded_from_saved_files(tmp_path, monkeypatch):
    """Compiled rounds kept whole on disk (fsd_eagle.precompiled): a first Session compiles and saves its
    prefill and round; once the process has forgotten them, a second Session loads them (compiling nothing)
    and samples the target's distribution."""
    from fsd_eagle import precompiled

    if not precompiled.supported():
        pytest.skip("this torch cannot save compiled functions")
    monkeypatch.setenv(precompiled.ENV, str(tmp_path))

    def forget():
        compiled_round.cache_clear()
        compiled_prefill.cache_clear()
        torch._dynamo.reset()

    forget()
    engine, prompt, first, second = stat_setup_on("cpu")
    rule = AcceptanceRule(SamplingConfig(temperature=0.7, top_p=0.9))
    try:
        sample_pairs_on(make_mode_session("compiled", engine, STAT_TREE, rule.form), prompt, rule, CHI_ROWS, seed=1)
        assert {p.parent.parent.name for p in tmp_path.rglob("*.pt")} == {"prefill", "run_round"}
        forget()
        monkeypatch.setattr(precompiled.Precompiled, "_compile", lambda *a: pytest.fail("compiled again"))
        n = 2000
        counts, accept_rate = sample_pairs_on(make_mode_session("compiled", engine, STAT_TREE, rule.form), prompt,
                                              rule, n, seed=5)
        assert accept_rate > 0.3
        assert chi_square_pvalue(counts, exact_pair_distribution(first, second, 0.7, 0.9), n) > 1e-3
    finally:
        forget()

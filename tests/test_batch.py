"""Batched decoding: B rows decoding different prompts in one target forward per round, with continuous
refill. Every row must decode exactly what its prompt decodes alone (greedy, fp32), whatever the other rows
do (other prompt lengths, finishing at other rounds, rows refilled mid-run), and sampling must stay lossless
per row."""

from __future__ import annotations

import copy
import dataclasses
import functools
from collections import Counter, defaultdict

import pytest
import torch

import fsd_eagle.verify as verify_module
from fsd_eagle.config import SamplingConfig, TreeConfig
from fsd_eagle.engine import Engine
from fsd_eagle.head import EagleHead, HeadConfig
from fsd_eagle.decode import prefill_bucket
from fsd_eagle.errors import ConfigError
from fsd_eagle.schedule import Request, Scheduler, decode, start_order
from fsd_eagle.session import Plan, Session, prefill_groups, prefill_rows_for, prefill_sizes, session_rows
from fsd_eagle.verify import AcceptanceRule

from conftest import chi_square_pvalue, cpu_kernels, gpu_session_on_the_cpu, has_cpu_compiler, reference_probs, tiny_model

GREEDY = AcceptanceRule()


def noisy(model, scale: float = 0.05, seed: int = 1):
    """A copy of ``model`` with Gaussian noise on its weight matrices: a draft model that agrees often."""
    out = copy.deepcopy(model)
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in out.parameters():
            if p.dim() > 1:
                p.add_(scale * p.std() * torch.randn(p.shape, generator=gen))
    return out


@functools.lru_cache(maxsize=None)
def engine(arch: str, drafter: str) -> Engine:
    """A tiny ``arch`` target with a random EAGLE head ("head") or a noisy copy of itself ("model")."""
    model = tiny_model(arch, max_position_embeddings=1024)
    if drafter == "head":
        torch.manual_seed(2)
        head = EagleHead(HeadConfig.for_target(model.config)).float().eval()
        return Engine(model, None, head=head)
    return Engine(model, None, draft_model=noisy(model))


def prompts(n: int, vocab: int, seed: int = 0) -> list[torch.Tensor]:
    """n prompts of different lengths (3 to 40 tokens)."""
    gen = torch.Generator().manual_seed(seed)
    return [torch.randint(0, vocab, (int(torch.randint(3, 41, (1,), generator=gen)),), generator=gen)
            for _ in range(n)]


def alone(eng: Engine, plan: Plan, prompt: torch.Tensor, n: int, rule=GREEDY, seed: int = 0) -> list[int]:
    session = Session(eng, Plan(plan.tree, plan.form, plan.drafting, batch=1))
    return [t for new in decode(session, prompt, n, rule, seed) for t in new]


def batched(eng: Engine, plan: Plan, requests: list[Request], rows: int | None = None,
            end_at: int | None = None) -> tuple[list[list[int]], Scheduler]:
    """Decode ``requests`` on one session of ``plan``; a request ends after token ``end_at`` (an "EOS")."""
    scheduler = Scheduler(Session(eng, plan), requests, rows)
    out: list[list[int]] = [[] for _ in requests]
    for i, tokens in scheduler.run():
        out[i] += tokens
        if end_at is not None and end_at in tokens:
            out[i] = out[i][: out[i].index(end_at) + 1]
            scheduler.finish(i)
    return out, scheduler


TREE = TreeConfig(total_tokens=12, depth=4, top_k=3)


@pytest.mark.parametrize("drafter", ["head", "model", "none"])
@pytest.mark.parametrize("arch", ["llama", "qwen3", "gemma3"])
def test_every_row_of_a_batch_decodes_as_it_would_alone(arch, drafter):
    """9 prompts of different lengths and budgets through 4 rows (rows finish at different rounds and are
    refilled): every output equals the prompt decoded alone, and AR-equal (greedy is exact). gemma3's
    sliding window (6 tokens) is far shorter than prompt + output."""
    eng = engine(arch, "head" if drafter == "none" else drafter)
    plan = Plan(TREE, GREEDY.form, drafting=drafter != "none", batch=4)
    vocab = eng.target.vocab_size
    ps = prompts(9, vocab, seed=1)
    budgets = [5 + 7 * (i % 4) for i in range(len(ps))]
    out, scheduler = batched(eng, plan, [Request(p, n, GREEDY) for p, n in zip(ps, budgets)])
    assert len(set(scheduler.row_of.values())) == 4  # every row served, and 9 > 4 prompts: rows were refilled
    for p, n, got in zip(ps, budgets, out):
        assert got == alone(eng, plan, p, n)
    ar = Plan(TREE, GREEDY.form, drafting=False, batch=1)
    assert out[0] == alone(eng, ar, ps[0], budgets[0])


def test_a_row_ended_early_is_refilled_and_the_rest_is_unchanged():
    """The caller ends prompts at an "EOS" token; their rows take the waiting prompts."""
    eng = engine("llama", "model")
    plan = Plan(TREE, GREEDY.form, batch=2)
    ps = prompts(6, eng.target.vocab_size, seed=2)
    full = [alone(eng, plan, p, 24) for p in ps]
    eos = Counter(t for f in full for t in f[2:12]).most_common(1)[0][0]  # a token several outputs contain
    out, _ = batched(eng, plan, [Request(p, 24, GREEDY) for p in ps], end_at=eos)
    for got, ref in zip(out, full):
        expect = ref[: ref.index(eos) + 1] if eos in ref else ref
        assert got == expect
    assert any(eos in f for f in full)


@pytest.mark.parametrize("drafter", ["head", "none"])
def test_an_open_ended_scheduler_takes_requests_between_rounds_and_decodes_each_as_alone(drafter):
    """Requests submitted at round boundaries while others decode (as a server submits them), one ended
    while it waits and one ended mid-decode: each of the others equals its prompt alone; the scheduler
    never returns, reports idle when drained, and ended requests free their rows."""
    eng = engine("llama", "head")
    plan = Plan(TREE, GREEDY.form, drafting=drafter == "head", batch=4)
    session = Session(eng, plan)
    ps = prompts(7, eng.target.vocab_size, seed=4)
    budgets = [6 + 5 * (i % 3) for i in range(len(ps))]
    scheduler = Scheduler(session, [], 4, open_ended=True, max_len=Scheduler.cache_for(session, 200))
    assert scheduler.fits(40, 100) and not scheduler.fits(150, 100)
    out: dict[int, list[int]] = {}
    arrivals = {0: [0, 1], 2: [2, 3, 4], 3: [5], 5: [6]}  # round boundary -> prompts submitted there
    index: dict[int, int] = {}
    boundaries = 0
    steps = scheduler.run()
    cancelled_waiting, cancelled_running = 4, 1
    for item in steps:
        if item is None:
            for p in arrivals.get(boundaries, []):
                index[p] = scheduler.submit(Request(ps[p], budgets[p], GREEDY))
                out[index[p]] = []
            if boundaries == 2:
                scheduler.finish(index[cancelled_waiting])  # a client gone before its request started
            boundaries += 1
            if scheduler.idle and boundaries > max(arrivals):
                break
            assert boundaries < 500
            continue
        i, tokens = item
        out[i] += tokens
        if i == index[cancelled_running] and len(out[i]) >= 2:
            scheduler.finish(i)
    assert scheduler.idle and len(scheduler.done) == len(ps)
    for p in range(len(ps)):
        got = out[index[p]]
        if p == cancelled_waiting:
            assert got == []
        elif p == cancelled_running:
            assert 2 <= len(got) < budgets[p] and got == alone(eng, plan, ps[p], budgets[p])[:len(got)]
        else:
            assert got == alone(eng, plan, ps[p], budgets[p])
    with pytest.raises(ConfigError, match="open_ended"):
        Scheduler(session, [], 4).submit(Request(ps[0], 3, GREEDY))


def test_fewer_prompts_than_rows_and_a_one_token_budget():
    eng = engine("qwen3", "head")
    plan = Plan(TREE, GREEDY.form, batch=8)
    ps = prompts(3, eng.target.vocab_size, seed=3)
    out, _ = batched(eng, plan, [Request(p, n, GREEDY) for p, n in zip(ps, (1, 9, 2))], rows=5)
    assert [len(o) for o in out] == [1, 9, 2]
    assert out == [alone(eng, plan, p, n) for p, n in zip(ps, (1, 9, 2))]


@pytest.mark.parametrize("children,pool", [("top", 0), ("sampled", 0), ("sampled", 5)])
def test_sampling_rows_with_their_seeds_decode_as_alone(children, pool):
    """Each row samples from its own seed's stream: the same tokens as the prompt alone with that seed, with
    the draft's top children and with children sampled from the draft (from a pool of 5). (The chi-square
    tests sample in batches for that reason.)"""
    eng = engine("llama", "model")
    rule = AcceptanceRule(SamplingConfig(temperature=0.9, top_p=0.95, children=children))
    plan = Plan(dataclasses.replace(TREE, pool=pool), rule.form, batch=4)
    ps = prompts(6, eng.target.vocab_size, seed=4)
    out, _ = batched(eng, plan, [Request(p, 16, rule, seed=10 + i) for i, p in enumerate(ps)])
    assert out == [alone(eng, plan, p, 16, rule, 10 + i) for i, p in enumerate(ps)]
    assert len({tuple(o) for o in out}) > 1


def test_prompts_prefilled_in_groups_and_refilled_together_decode_as_alone(monkeypatch):
    """12 prompts on 12 rows (a 16-row Session): the first fill prefills the 8 longest prompts in one padded
    forward and the other 4 in a 4-row one; with refill_at = 3, freed rows wait until 3 are free (or too few
    prompts wait) and start together. Every output equals its prompt alone, sampled rows too."""
    from fsd_eagle import session as session_module

    eng = engine("llama", "head")
    rule = AcceptanceRule(SamplingConfig(temperature=0.8))
    plan = Plan(TREE, rule.form, batch=session_rows(12))
    assert plan.batch == 16 and session_module.PREFILL_GROUP == 8
    ps = prompts(20, eng.target.vocab_size, seed=5)
    budgets = [3 + 5 * (i % 5) for i in range(len(ps))]
    groups: list[int] = []
    original = Session.start_rows
    monkeypatch.setattr(Session, "start_rows", lambda self, rows, *a: groups.append(len(rows)) or original(self, rows, *a))
    session = Session(eng, plan)
    scheduler = Scheduler(session, [Request(p, n, rule, seed=i) for i, (p, n) in enumerate(zip(ps, budgets))], 12,
                          refill_at=3)
    out: list[list[int]] = [[] for _ in ps]
    for i, tokens in scheduler.run():
        out[i] += tokens
    assert groups[0] == 12 and sum(groups) == 20
    assert all(g >= 3 for g in groups[1:-1]) and len(groups) > 2  # deferred refills, several rows at once
    for i, (p, n) in enumerate(zip(ps, budgets)):
        assert out[i] == alone(eng, plan, p, n, rule, i)


def test_prefill_rows_are_powers_of_two_up_to_the_group():
    """A batch Session prefills into 1, 2, 4 and 8 rows (fewer with fewer rows), and k prompts take the
    fewest rows that hold them: 3 prompts pad 4 rows, not 8."""
    assert [prefill_sizes(b) for b in (1, 2, 3, 4, 5, 8, 16, 64)] == [
        (1,), (1, 2), (1, 2, 3), (1, 2, 4), (1, 2, 4, 5), (1, 2, 4, 8), (1, 2, 4, 8), (1, 2, 4, 8)]
    sizes = prefill_sizes(64)
    assert [prefill_rows_for(k, sizes) for k in range(1, 9)] == [1, 2, 4, 4, 8, 8, 8, 8]


def test_prompts_prefilled_together_are_grouped_by_length():
    """Groups of at most ``most`` prompts, longest first: the short prompts are not padded to the long ones
    (in the order given, groups of 2 would be (40, 1400) and (60, 1500))."""
    assert prefill_groups([40, 1400, 60, 1500], 2) == [[3, 1], [2, 0]]
    assert prefill_groups([5, 9, 5, 7, 9], 8) == [[1, 4, 3, 0, 2]]
    assert prefill_groups([3, 1, 2], 1) == [[0], [2], [1]]
    # long prompts never pad a prompt to more than twice its length: the long prompt prefills alone; short
    # ones (up to PREFILL_POW2_UP_TO tokens, where a prefill costs launches) still share a group
    assert prefill_groups([10_000, 20, 30, 25], 4) == [[0], [2, 3, 1]]
    assert prefill_groups([2000, 1000, 999, 600, 40], 8) == [[0, 1], [2, 3], [4]]
    assert prefill_groups([500, 5, 130, 40], 8) == [[0, 2, 3, 1]]


def test_waiting_prompts_start_shortest_first():
    """Rows take prompts by length (ties in list order): with one row, prompts of 30, 5, 20 and 5 tokens
    start in the order 1, 3, 2, 0; results still map to their own index."""
    assert start_order([30, 5, 20, 5]) == [1, 3, 2, 0]
    eng = engine("llama", "head")
    plan = Plan(TREE, GREEDY.form, batch=1)
    gen = torch.Generator().manual_seed(7)
    ps = [torch.randint(0, eng.target.vocab_size, (n,), generator=gen) for n in (30, 5, 20, 5)]
    scheduler = Scheduler(Session(eng, plan), [Request(p, 3, GREEDY) for p in ps])
    out: list[list[int]] = [[] for _ in ps]
    first_seen = []
    for i, tokens in scheduler.run():
        if not out[i]:
            first_seen.append(i)
        out[i] += tokens
    assert first_seen == [1, 3, 2, 0]
    assert out == [alone(eng, plan, p, 3) for p in ps]


def test_a_refill_group_pads_the_fewest_prefill_rows_to_its_longest_prompt(monkeypatch):
    """start_rows on a 16-row Session: 3 prompts prefill in one 4-row forward; 11 prompts in an 8-row forward
    of the 8 longest and a 4-row one of the 3 shortest; the first tokens come back in the rows' order and
    every row decodes as its prompt alone."""
    eng = engine("llama", "head")
    plan = Plan(TREE, GREEDY.form, batch=16)
    session = Session(eng, plan)
    seen: list[tuple[int, list[int]]] = []
    original = Session._prefill

    def spy(self, pre, prompts):
        seen.append((pre.rows, [p.shape[0] for p in prompts]))
        return original(self, pre, prompts)

    monkeypatch.setattr(Session, "_prefill", spy)
    gen = torch.Generator().manual_seed(8)
    lengths = [20 + (7 * i) % 21 for i in range(11)]  # 20 to 40 tokens: no prompt is half its group's longest
    ps = [torch.randint(0, eng.target.vocab_size, (n,), generator=gen) for n in lengths]
    session.allocate(256)
    firsts = session.start_rows([5, 9, 2], ps[:3], [GREEDY] * 3, [0] * 3)
    assert seen == [(4, sorted(lengths[:3], reverse=True))]
    assert [f.read() for f in firsts] == [alone(eng, plan, p, 1)[0] for p in ps[:3]]
    seen.clear()
    session.allocate(256)
    firsts = session.start_rows(list(range(11)), ps, [GREEDY] * 11, [0] * 11)
    ranked = sorted(lengths, reverse=True)
    assert [(rows, sorted(ls, reverse=True)) for rows, ls in seen] == [(8, ranked[:8]), (4, ranked[8:])]
    assert [f.read() for f in firsts] == [alone(eng, plan, p, 1)[0] for p in ps]


def test_prefill_buckets_pad_long_prompts_by_at_most_an_eighth():
    """Powers of two up to 512 tokens (at least 64), then 8 buckets per doubling: 20 graphs' lengths cover
    prompts up to 2048 tokens, and a padded prompt above 512 tokens is less than 9/8 of its length."""
    assert [prefill_bucket(n) for n in (1, 64, 65, 300, 512, 513, 577, 1024, 1025, 1598, 2048, 2049)] == [
        64, 64, 128, 512, 512, 576, 640, 1024, 1152, 1664, 2048, 2304]
    assert len({prefill_bucket(n) for n in range(1, 2049)}) == 20
    for n in range(513, 9000, 7):
        assert n <= prefill_bucket(n) < n * 9 / 8 and prefill_bucket(prefill_bucket(n)) == prefill_bucket(n)


def test_prepare_prefills_runs_every_prefill_rows_at_every_bucket(monkeypatch):
    """``prepare_prefills`` (graph mode) runs a prefill of each PrefillRows at each padded length of the
    prompts given, so that their graphs are captured before a timed run; refused where the caches are too
    short; eagerly it does nothing."""
    eng = engine("llama", "head")
    session = Session(eng, Plan(TREE, GREEDY.form, batch=8))
    seen: list[tuple[int, int]] = []
    monkeypatch.setattr(Session, "_prefill", lambda self, pre, ps: seen.append((pre.rows, ps[0].shape[0])))
    session.allocate(1024)
    session.prepare_prefills([5, 70, 600, 60])
    assert seen == []  # eagerly: nothing to capture
    session.use_graph = True  # what a CUDA Session does (its _prefill captures on first use)
    session.prepare_prefills([5, 70, 600, 60])
    assert seen == [(rows, size) for size in (64, 128, 640) for rows in (1, 2, 4, 8)]
    with pytest.raises(ConfigError, match="allocate"):
        session.prepare_prefills([1500])


def test_batch_buckets():
    assert [session_rows(n) for n in (1, 2, 3, 5, 8, 9, 33, 64, 100)] == [1, 2, 4, 8, 8, 16, 64, 64, 64]


# --------------------------------------------------------------------------- sampling per row (chi-square)

STAT_VOCAB = 12
STAT_TREE = TreeConfig(total_tokens=4, depth=1, top_k=3)


@functools.lru_cache(maxsize=None)
def stat_setup():
    """A one-layer model over 12 tokens, a noisy copy as drafter, a prompt, and the exact distributions of
    the first two tokens."""
    model = tiny_model("llama", vocab_size=STAT_VOCAB, hidden_size=32, num_layers=1, initializer_range=0.3, seed=3)
    prompt = torch.tensor([1, 5, 3, 7])
    with torch.no_grad():
        first = model(prompt[None]).logits[0, -1]
        second = model(torch.cat([prompt.expand(STAT_VOCAB, -1), torch.arange(STAT_VOCAB)[:, None]], 1)).logits[:, -1]
    return Engine(model, None, draft_model=noisy(model, 0.2)), prompt, first, second


def per_row_samples(n: int, rows: int, seed: int, children: str = "top") -> dict[int, Counter]:
    eng, prompt, _, _ = stat_setup()
    rule = AcceptanceRule(SamplingConfig(temperature=1.0, children=children))
    requests = [Request(prompt, 2, rule, seed=seed * n + i) for i in range(n)]
    tree = STAT_TREE if children == "top" else TreeConfig(total_tokens=6, depth=2, top_k=3)
    out, scheduler = batched(eng, Plan(tree, rule.form, batch=rows), requests)
    counts: dict[int, Counter] = defaultdict(Counter)
    for i, tokens in enumerate(out):
        counts[scheduler.row_of[i]][tuple(tokens)] += 1
    return counts


def exact_pairs() -> dict:
    _, _, first, second = stat_setup()
    p1, p2 = reference_probs(first, 1.0, 1.0), reference_probs(second, 1.0, 1.0)
    return {(a, b): float(p1[a] * p2[a, b]) for a in range(STAT_VOCAB) for b in range(STAT_VOCAB)}


@pytest.mark.parametrize("children", ["top", "sampled"])
def test_sampling_is_lossless_in_every_row_of_a_batch(children):
    counts = per_row_samples(1600, 4, seed=0, children=children)
    assert len(counts) == 4
    for row, c in counts.items():
        total = sum(c.values())
        assert total >= 300
        assert chi_square_pvalue(c, exact_pairs(), total) > 1e-3, f"row {row}"


def test_the_per_row_test_detects_a_broken_rule(monkeypatch):
    """Sampling the bonus without removing the rejected children skews the second token in every row."""
    monkeypatch.setattr(verify_module, "_remove", lambda p, tokens, drop: p)
    counts = per_row_samples(1600, 4, seed=0)
    assert max(chi_square_pvalue(c, exact_pairs(), sum(c.values())) for c in counts.values()) < 1e-3


@pytest.mark.integration
@pytest.mark.parametrize("autoregressive", [False, True])
def test_default_model_batch_equals_each_prompt_alone(autoregressive):
    """SmolLM2-135M-Instruct with its shipped head, fp32: a list of MT-bench prompts through 2 rows (with
    refills) gives each prompt's own greedy output."""
    import sys
    from pathlib import Path

    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
    from eval.tasks import load_mt_bench

    gen = default_generator()
    texts = [q.turns[0] for q in load_mt_bench(limit=5)]
    many = gen.generate(texts, max_new_tokens=24, batch_size=2, autoregressive=autoregressive)
    for text, result in zip(texts, many):
        assert result.token_ids == gen.generate(text, max_new_tokens=24, autoregressive=autoregressive).token_ids


@functools.lru_cache(maxsize=None)
def default_generator():
    from fsd_eagle import SpeculativeGenerator

    return SpeculativeGenerator.load(device="cpu", dtype="float32", tree=TreeConfig(total_tokens=16, depth=5, top_k=4))


def test_stream_of_many_prompts_interleaves_pieces_that_add_up_to_each_text(tiny_llama):
    """``stream`` of a list yields (index, piece) as rounds complete; each prompt's pieces join to the text
    that ``generate`` gives it alone, and its result comes last."""
    from fsd_eagle import SpeculativeGenerator

    class Tok:
        eos_token_id = None
        chat_template = None

        def decode(self, ids, skip_special_tokens=True):
            return "".join(f"<{i}>" for i in ids)

    torch.manual_seed(2)
    head = EagleHead(HeadConfig.for_target(tiny_llama.config)).float().eval()
    gen = SpeculativeGenerator(tiny_llama, Tok(), head, tree=TREE)
    ps = [p.tolist() for p in prompts(5, gen.target.vocab_size, seed=6)]
    texts: dict[int, str] = defaultdict(str)
    results = {}
    order = []
    for i, piece in gen.stream(ps, 12, batch_size=2, with_result=True):
        if isinstance(piece, str):
            assert i not in results
            texts[i] += piece
            order.append(i)
        else:
            results[i] = piece
    assert sorted(results) == list(range(5))
    for i, p in enumerate(ps):
        alone_result = gen.generate(p, 12)
        assert texts[i] == results[i].text == alone_result.text
        assert results[i].token_ids == alone_result.token_ids
    assert order != sorted(order)  # pieces of different prompts interleave


@pytest.mark.filterwarnings("ignore:.*flex_attention.*")
@pytest.mark.parametrize("arch", ["llama", "gemma3"])
def test_batched_rounds_with_flex_attention_decode_as_alone(arch):
    """The tree attention of compiled GPU rounds (FlexAttention with one prefix per row), run eagerly: 6 prompts
    of 90-150 tokens through 3 rows, so that rows' prefixes end in different 128-slot blocks and cross into
    the next while they decode; every output equals the prompt decoded alone with SDPA. (Eager FlexAttention
    applies the mask function everywhere; that the block lists cover the mask is
    test_engine.test_slot_mask_and_its_flex_blocks.) gemma3's sliding window (6 tokens) is far shorter than
    prompt + output."""
    eng = engine(arch, "head")
    plan = Plan(TREE, GREEDY.form, drafting=True, batch=3)
    gen = torch.Generator().manual_seed(5)
    ps = [torch.randint(0, eng.target.vocab_size, (int(torch.randint(90, 151, (1,), generator=gen)),),
                        generator=gen) for _ in range(6)]
    session = Session(eng, plan)
    session.attention = "flex"  # what a compiled GPU session runs (here eagerly: the slow reference)
    scheduler = Scheduler(session, [Request(p, 40, GREEDY) for p in ps])
    out: list[list[int]] = [[] for _ in ps]
    for i, tokens in scheduler.run():
        out[i] += tokens
    assert session.target.attention == "flex"
    for p, got in zip(ps, out):
        assert got == alone(eng, plan, p, 40)


@pytest.mark.skipif(not has_cpu_compiler(), reason="torch.compile on the CPU needs g++ and Python headers")
@pytest.mark.filterwarnings("ignore:.*flex_attention.*")
@pytest.mark.parametrize("attention", ["flex", "sdpa"])
def test_a_compiled_batch_session_decodes_as_alone(monkeypatch, attention):
    """A batch Session run as on a GPU with ``compile=True`` (prefills and the round compiled by inductor,
    graphs replayed: ``gpu_session_on_the_cpu``), with either tree attention (SDPA is a GPU batch
    Session's default, FlexAttention a user's choice): 6 prompts of 90-150 tokens through 3 rows, refilled
    and crossing 128-slot blocks as in the test above; every output equals the prompt decoded alone,
    eagerly with SDPA."""
    from fsd_eagle.decode import compiled_prefill, compiled_round

    gpu_session_on_the_cpu(monkeypatch, lambda fn: "inductor")
    compiled_round.cache_clear()
    torch._dynamo.reset()
    try:
        eng = engine("llama", "head")
        plan = Plan(TREE, GREEDY.form, drafting=True, batch=3, graphs=True, compile=True)
        gen = torch.Generator().manual_seed(5)
        ps = [torch.randint(0, eng.target.vocab_size, (int(torch.randint(90, 151, (1,), generator=gen)),),
                            generator=gen) for _ in range(6)]
        session = Session(eng, plan)
        session.use_graph, session.compile, session.attention = True, True, attention  # a GPU session's
        scheduler = Scheduler(session, [Request(p, 40, GREEDY) for p in ps])
        out: list[list[int]] = [[] for _ in ps]
        with torch._inductor.config.patch(cpu_kernels(attention)):
            for i, tokens in scheduler.run():
                out[i] += tokens
        assert (session.mode, session.attention, session.target.attention) == ("compiled", attention, attention)
    finally:
        compiled_round.cache_clear()
        compiled_prefill.cache_clear()
        torch._dynamo.reset()
    for p, got in zip(ps, out):
        assert got == alone(eng, plan, p, 40)


def test_batches_compile_with_sdpa_unless_flex_is_asked_for():
    """The tree attention a Session's compiled rounds get: FlexAttention for one row, SDPA for a batch (its
    FlexAttention form is checked on a GPU by eval/device/flex_check.py), FlexAttention for a batch only when
    asked for; uncompiled rounds always SDPA."""
    from fsd_eagle.decode import round_attention

    config = engine("llama", "head").target.config
    assert round_attention(True, config) == "flex"
    assert round_attention(True, config, None, rows=8) == "sdpa"
    assert round_attention(True, config, "flex", rows=8) == "flex"
    assert round_attention(True, config, "sdpa", rows=1) == "sdpa"
    assert round_attention(False, config, "flex", rows=1) == "sdpa"

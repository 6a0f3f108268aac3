"""Shared fixtures: tiny random causal LMs (fp32, CPU) built from configs, no downloads.

``tiny_model(arch, ...)`` builds one; the session fixtures ``tiny_llama``, ``tiny_qwen2`` and ``tiny_gemma3``
share one instance each (treat them as read-only: ``copy.deepcopy`` before changing weights).
"""

from __future__ import annotations

import os
import shutil
import sysconfig
import warnings
from collections import Counter
from pathlib import Path

import pytest
import torch

from checkout_guard import changes, checkout_state

# Tiny matmuls: thread start-up and contention with other processes cost far more than they save
# (measured 10-100x slower with 2 threads on a busy 2-core machine). OMP_NUM_THREADS also keeps
# SpeculativeGenerator.load's default thread count from changing it (tests of that default unset it).
os.environ.setdefault("OMP_NUM_THREADS", "1")
torch.set_num_threads(1)

ARCHS = ("llama", "qwen2", "qwen3", "gemma3", "mistral")


def tiny_config(arch: str = "llama", *, vocab_size: int = 128, hidden_size: int = 64, num_layers: int = 2,
                **overrides):
    """A small config of ``arch``: llama (GQA), qwen2 (attention bias), gemma3 (a sliding window of 6
    tokens on layer 0, full attention on layer 1, final logit soft-capping; untied embeddings, as tied
    random ones make greedy decoding repeat the last token), mistral (a sliding window of 6 tokens on every
    layer, set by ``sliding_window`` alone, without ``layer_types``)."""
    from transformers import Gemma3TextConfig, LlamaConfig, MistralConfig, Qwen2Config, Qwen3Config

    common = dict(vocab_size=vocab_size, hidden_size=hidden_size, intermediate_size=2 * hidden_size,
                  num_hidden_layers=num_layers, num_attention_heads=4, num_key_value_heads=2,
                  max_position_embeddings=512, initializer_range=0.1)
    if arch == "llama":
        kwargs = dict(common)
        cls = LlamaConfig
    elif arch == "qwen2":
        kwargs = dict(common)
        cls = Qwen2Config
    elif arch == "qwen3":  # q/k norms, explicit head_dim
        kwargs = dict(common, head_dim=hidden_size // 4)
        cls = Qwen3Config
    elif arch == "gemma3":
        head_dim = hidden_size // 4
        kinds = ["sliding_attention", "full_attention"]
        kwargs = dict(common, head_dim=head_dim, query_pre_attn_scalar=head_dim, sliding_window=6,
                      layer_types=[kinds[i % 2] for i in range(num_layers)], final_logit_softcapping=30.0,
                      tie_word_embeddings=False)
        cls = Gemma3TextConfig
    elif arch == "mistral":
        kwargs = dict(common, sliding_window=6)
        cls = MistralConfig
    else:
        raise ValueError(f"unknown tiny arch {arch!r}; choose one of {ARCHS}")
    kwargs.update(overrides)
    return cls(**kwargs)


def tiny_model(arch: str = "llama", *, seed: int = 0, **config_kwargs):
    """A randomly initialized fp32 causal LM of ``arch`` in eval mode (deterministic given ``seed``)."""
    from transformers import (Gemma3ForCausalLM, LlamaForCausalLM, MistralForCausalLM, Qwen2ForCausalLM,
                              Qwen3ForCausalLM)

    cls = {"llama": LlamaForCausalLM, "qwen2": Qwen2ForCausalLM, "qwen3": Qwen3ForCausalLM,
           "gemma3": Gemma3ForCausalLM, "mistral": MistralForCausalLM}[arch]
    config = tiny_config(arch, **config_kwargs)
    with torch.random.fork_rng():
        torch.manual_seed(seed)
        model = cls(config)
        # Biases and norm weights start at 0 / 1: offset them so attention biases and norm scales matter.
        with torch.no_grad():
            for name, param in model.named_parameters():
                if param.dim() == 1:
                    param.add_(0.1 * torch.randn_like(param))
    return model.float().eval()


@pytest.fixture
def inductor_freezing(monkeypatch):
    """Compiled rounds made while active use inductor's freezing (``FSD_EAGLE_INDUCTOR_FREEZING=1``), with
    the concatenation of parallel matmuls that the CPU backend only does when asked; ``compiled_round`` is
    made again on entry and exit (it reads the setting when it is made)."""
    from fsd_eagle.decode import FREEZING_ENV, compiled_round

    monkeypatch.setenv(FREEZING_ENV, "1")
    compiled_round.cache_clear()
    with torch._inductor.config.patch({"cpp.enable_concat_linear": True}):
        yield
    compiled_round.cache_clear()


@pytest.fixture
def mm_calls(monkeypatch) -> list:
    """Shapes of the first operands that ``torch.mm`` multiplied in fsd_eagle.ops while the test ran: the
    weights of ``ops.project``'s transposed path (``weight @ x.T``)."""
    from fsd_eagle import ops

    calls: list = []
    mm = torch.mm

    def spy(a, b, *args, **kwargs):
        calls.append(tuple(a.shape))
        return mm(a, b, *args, **kwargs)

    monkeypatch.setattr(ops.torch, "mm", spy)
    return calls


@pytest.fixture(scope="session")
def tiny_llama():
    return tiny_model("llama")


@pytest.fixture(scope="session")
def tiny_qwen2():
    return tiny_model("qwen2")


@pytest.fixture(scope="session")
def tiny_gemma3():
    return tiny_model("gemma3")


def make_session(model=None, tree=None, rule=None, *, head=None, draft_model=None, engine=None,
                 drafting: bool = True, **plan):
    """A Session over ``engine`` (default: a new Engine of ``model`` with ``head`` or ``draft_model``, no
    tokenizer) running ``tree`` (default TreeConfig()) under ``rule``'s form (default: greedy); ``plan``: the
    other Plan fields (graphs, compile, attention, batch; graphs default off)."""
    from fsd_eagle.config import TreeConfig
    from fsd_eagle.engine import Engine
    from fsd_eagle.session import Plan, Session
    from fsd_eagle.verify import AcceptanceRule

    if engine is None:
        engine = Engine(model, None, head=head, draft_model=draft_model)
    form = (rule or AcceptanceRule()).form
    return Session(engine, Plan(tree or TreeConfig(), form, drafting=drafting, **plan))


def decode_all(session, prompt, n, rule=None, seed=0, stats=None):
    """``schedule.decode`` of one prompt on ``session``: (every new token id, the DecodeStats)."""
    from fsd_eagle.decode import DecodeStats
    from fsd_eagle.schedule import decode
    from fsd_eagle.verify import AcceptanceRule

    stats = stats if stats is not None else DecodeStats()
    out: list[int] = []
    for new in decode(session, prompt, n, rule or AcceptanceRule(), seed, stats):
        out += new
    return out, stats


def verify(tree, logits, rule, rng=None):
    """``verify_tree`` under an AcceptanceRule: its form and values; ``rng`` a RandomStream, or an int seed
    (a fresh stream at step 0 for every batch row)."""
    from fsd_eagle.rng import RandomStream
    from fsd_eagle.verify import verify_tree

    if isinstance(rng, int):
        rng = RandomStream.create(logits.device, rng, batch=logits.shape[0])
    return verify_tree(tree, logits, rule.form, rule.values(logits.device), rng)


def ancestors(parents: torch.Tensor) -> torch.Tensor:
    """``[n, n]`` bool: node j is an ancestor of node i or i itself, for a tree given by its parents ``[n]``
    (parents before children, the root its own parent)."""
    n = parents.shape[0]
    anc = torch.eye(n, dtype=torch.bool)
    for i in range(1, n):
        anc[i] |= anc[parents[i]]
    return anc


def reference_probs(logits: torch.Tensor, temperature: float, top_p: float) -> torch.Tensor:
    """softmax(logits / T) restricted to the smallest top set with mass >= top_p (float64, renormalized)."""
    p = torch.softmax(logits.double() / temperature, -1)
    if top_p < 1.0:
        sorted_p, order = p.sort(-1, descending=True)
        before = sorted_p.cumsum(-1) - sorted_p
        keep = torch.zeros_like(p, dtype=torch.bool).scatter(-1, order, before < top_p)
        p = torch.where(keep, p, 0.0)
        p = p / p.sum(-1, keepdim=True)
    return p


def chi_square_pvalue(counts: Counter, expected: dict, n: int) -> float:
    """Goodness of fit of ``counts`` to the probabilities ``expected`` (cells with an expected count below
    5 are pooled); p-value via the regularized upper incomplete gamma function."""
    if not set(counts) <= {c for c, p in expected.items() if p > 0}:
        return 0.0  # a sample the model cannot produce
    cells = sorted(expected, key=lambda c: expected[c])
    obs, exp, pool_o, pool_e = [], [], 0.0, 0.0
    for c in cells:
        e = expected[c] * n
        if e < 5:
            pool_o, pool_e = pool_o + counts.get(c, 0), pool_e + e
        else:
            obs.append(counts.get(c, 0))
            exp.append(e)
    if pool_e > 0:
        if pool_e < 5 and exp:  # still too small: merge with the smallest big cell
            obs[0], exp[0] = obs[0] + pool_o, exp[0] + pool_e
        else:
            obs.append(pool_o)
            exp.append(pool_e)
    obs_t, exp_t = torch.tensor(obs, dtype=torch.float64), torch.tensor(exp, dtype=torch.float64)
    stat = ((obs_t - exp_t) ** 2 / exp_t).sum()
    df = len(obs) - 1
    assert df >= 3
    return float(torch.special.gammaincc(torch.tensor(df / 2, dtype=torch.float64), stat / 2))


# Rows of the sessions that chi-square tests sample on: every request is a two-token decode that ends
# after one round, so 64 rows take 64 samples a round (a one-row session took ~20 ms a sample on the CPU).
CHI_ROWS = 64


def sample_pairs_on(session, prompt, rule, n: int, seed: int):
    """n two-token decodes of ``prompt`` on ``session`` (through ``schedule.Scheduler``, ``session.batch``
    rows at a time), decode i with seed ``seed * n + i``: the counts of the token pairs, and the share of
    decodes whose first round accepted a draft token. A seed decodes the same tokens in any row of any
    batch as alone (tests/test_batch.py), so the counts do not depend on the session's rows."""
    from fsd_eagle.schedule import Request, Scheduler

    requests = [Request(prompt, 2, rule, seed * n + i) for i in range(n)]
    out: list[list[int]] = [[] for _ in requests]
    for i, tokens in Scheduler(session, requests).run():
        out[i] += tokens
    counts = Counter(tuple(tokens) for tokens in out)
    return counts, sum(r.stats.accept_lengths[0] > 1 for r in requests) / n


def spy_generate(monkeypatch, counts, value) -> list:
    """Patch SpeculativeGenerator.generate to append ``value(kwargs)`` to the returned list before each call
    whose prompt ``counts(prompt)`` (benchmarks' calls, counted by tests)."""
    from fsd_eagle.api import SpeculativeGenerator

    calls = []
    real = SpeculativeGenerator.generate

    def spying(self, prompt, *args, **kwargs):
        if counts(prompt):
            calls.append(value(kwargs))
        return real(self, prompt, *args, **kwargs)

    monkeypatch.setattr(SpeculativeGenerator, "generate", spying)
    return calls


SCALAR_KERNELS = {"cpp.simdlen": 1}  # no vector ISA matches a SIMD length of 1


def cpu_kernels(attention: str = "sdpa") -> dict:
    """Inductor settings for a test's compilation on the CPU: scalar C++ kernels (SCALAR_KERNELS), the same
    graphs and fusions without inductor's vectorized variant of each loop, whose code generation took about
    a third of a cold compilation on 2 cores (a chi-square test's 96 s -> 62 s). What the tests check (one
    graph per round, compiled outputs equal to eager ones, the target's distribution) does not depend on it;
    the GPU compiles Triton kernels either way. FlexAttention's CPU template needs the vectorized kernels:
    none for it."""
    return {} if attention == "flex" else SCALAR_KERNELS


def has_cpu_compiler() -> bool:
    """Whether torch.compile can build CPU code here (inductor needs g++ and the Python headers)."""
    include = sysconfig.get_paths().get("include", "")
    return shutil.which("g++") is not None and os.path.isfile(os.path.join(include, "Python.h"))


class _Replay:
    """Stands in for a captured CUDA graph on the CPU: replaying calls the function again."""

    def __init__(self, fn, out):
        self.fn, self.out = fn, out

    def replay(self):
        fresh = self.fn()
        torch.utils._pytree.tree_map(lambda o, f: o.copy_(f) if isinstance(o, torch.Tensor) else None, self.out, fresh)

    def pool(self):  # a CUDA graph's memory pool handle (none on the CPU)
        return None


def gpu_session_on_the_cpu(monkeypatch, backend_of) -> None:
    """What a GPU Session compiles and captures, run on the CPU: torch.compile with the backend
    ``backend_of(fn)`` (e.g. a frame counter for dynamo alone, or "inductor") and a stand-in capture that runs
    the function once (compiling it), restores the state and replays by calling it again; the compiled
    prefill is made afresh. A Session then runs as on a GPU once its ``use_graph`` and ``compile`` are set."""
    import fsd_eagle.decode as decode_module
    import fsd_eagle.session as session_module

    compile_fn = torch.compile

    def counted(fn, **kwargs):
        return compile_fn(fn, backend=backend_of(fn), **kwargs)

    def capture(fn, state, pool=None):
        saved = [t.clone() for t in state]
        out = fn()
        for t, v in zip(state, saved):
            t.copy_(v)
        return _Replay(fn, out), out

    monkeypatch.setattr(torch, "compile", counted)
    monkeypatch.setattr(decode_module, "capture", capture)
    monkeypatch.setattr(session_module, "capture", capture)
    decode_module.compiled_prefill.cache_clear()


@pytest.fixture(autouse=True)
def no_saved_compiled_functions(monkeypatch):
    """Compiled rounds are not written to disk unless a test asks (fsd_eagle.precompiled): a command that a
    test runs in this process sets the folder for the process, which is undone after each test."""
    monkeypatch.delenv("FSD_EAGLE_PRECOMPILED", raising=False)


_CHECKOUT = Path(__file__).resolve().parent.parent
_STATE_AT_START = pytest.StashKey[dict]()


def pytest_sessionstart(session):
    """Note the checkout's state (tests/checkout_guard.py) before the first test runs."""
    state = checkout_state(_CHECKOUT)
    if state is not None:
        session.config.stash[_STATE_AT_START] = state


def pytest_sessionfinish(session, exitstatus):
    """Fail the run when the tests changed, added or deleted a file of the checkout."""
    before = session.config.stash.get(_STATE_AT_START, None)
    after = checkout_state(_CHECKOUT) if before is not None else None
    changed = changes(before, after) if after is not None else []
    if changed:
        reporter = session.config.pluginmanager.get_plugin("terminalreporter")
        if reporter is not None:
            reporter.write("\n")
            reporter.write_line(f"the tests changed the checkout {_CHECKOUT}: " + ", ".join(changed), red=True)
        session.exitstatus = pytest.ExitCode.TESTS_FAILED

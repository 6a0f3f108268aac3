"""Compiled rounds and prefills kept on disk whole (fsd_eagle.precompiled): what a restart or a server's
take-over loads instead of tracing and compiling again."""

from __future__ import annotations

import dataclasses
import warnings

import pytest
import torch
from torch._dynamo.utils import counters

from conftest import cpu_kernels, decode_all, gpu_session_on_the_cpu, has_cpu_compiler, make_session
from fsd_eagle import precompiled
from fsd_eagle.config import TreeConfig
from fsd_eagle.decode import compiled_prefill, compiled_round, variant_of
from fsd_eagle.engine import Engine
from fsd_eagle.sampling import RuleForm
from test_engine import _engine, random_prompt

needs_packaging = pytest.mark.skipif(not (has_cpu_compiler() and precompiled.supported()),
                                     reason="needs a CPU compiler and a torch that saves compiled functions")


@pytest.fixture
def folder(tmp_path, monkeypatch):
    monkeypatch.setenv(precompiled.ENV, str(tmp_path / "functions"))
    return tmp_path / "functions"


def test_the_folder_comes_from_the_environment(monkeypatch, tmp_path):
    monkeypatch.delenv(precompiled.ENV, raising=False)
    assert precompiled.folder() is None  # nothing is kept unless asked
    assert precompiled.use_folder(tmp_path / "a") == tmp_path / "a"
    assert precompiled.use_folder(tmp_path / "b") == tmp_path / "a"  # a set variable wins
    monkeypatch.setenv(precompiled.ENV, "0")
    assert precompiled.folder() is None
    monkeypatch.setenv(precompiled.ENV, str(tmp_path / "c"))
    if precompiled.supported():
        assert precompiled.folder() == tmp_path / "c"
    monkeypatch.setattr(precompiled, "supported", lambda: False)  # a torch that cannot save them: none kept
    assert precompiled.folder() is None


def test_a_specialization_is_written_atomically_under_the_digest_of_its_bytes(tmp_path):
    first = precompiled.save(tmp_path / "v", b"compiled")
    again = precompiled.save(tmp_path / "v", b"compiled")
    other = precompiled.save(tmp_path / "v", b"other")
    assert first == again != other
    assert sorted(p.name for p in (tmp_path / "v").iterdir()) == sorted([first.name, other.name])  # no temporaries


def test_an_unreadable_file_is_a_cache_miss_with_a_warning(tmp_path):
    bad = tmp_path / "broken.pt"
    bad.write_bytes(b"not a compiled function")
    with pytest.warns(UserWarning, match="compiles again"):
        assert precompiled.load(bad) is None


def test_variants_differ_by_settings_not_by_tensor_values():
    tree, other_tree = TreeConfig(total_tokens=12, depth=4, top_k=3), TreeConfig(total_tokens=16, depth=4, top_k=3)
    greedy = RuleForm()
    a = variant_of(torch.zeros(2, 3), tree, greedy)
    assert a == variant_of(torch.ones(5, 7), tree, greedy)  # shapes are the guards' part
    assert a != variant_of(torch.zeros(2, 3), other_tree, greedy)
    assert a != variant_of(torch.zeros(2, 3, dtype=torch.bfloat16), tree, greedy)
    assert a != variant_of(torch.zeros(2, 3), tree, dataclasses.replace(greedy, fuzzy=True))


def test_guards_that_cannot_be_saved_are_left_out():
    from torch._dynamo.types import GuardFilterEntry

    class Local:  # a class defined in a function: its objects cannot be saved
        pass

    def entry(guard_type, value=None, is_global=False, derived=()):
        return GuardFilterEntry(name="x", has_value=value is not None, value=value, guard_type=guard_type,
                                derived_guard_types=derived, is_global=is_global, orig_guard=None)

    kept = precompiled.serializable_guards([
        entry("TENSOR_MATCH", torch.zeros(1)), entry("ID_MATCH", 1), entry("TYPE_MATCH", Local()),
        entry("CONSTANT_MATCH", 3, is_global=True), entry("TYPE_MATCH", 3, derived=("ID_MATCH",)),
        entry("EQUALS_MATCH", "sdpa"), entry("SEQUENCE_LENGTH", (1,)),
        dataclasses.replace(entry("SEQUENCE_LENGTH", (1,)), name="f.__closure__[0].cell_contents.__defaults__"),
        dataclasses.replace(entry("LENGTH_CHECK", (1,)),
                            name="len(__import__('torch').utils._pytree.SUPPORTED_NODES)")])
    assert kept == [True, False, False, False, False, True, True, False, False]


@needs_packaging
@pytest.mark.filterwarnings("ignore:.*flex_attention.*")
def test_saved_rounds_decode_exactly_and_a_new_session_loads_them_without_tracing(tiny_llama, folder, monkeypatch):
    """A compiled Session (as on a GPU: prefill and round compiled, graphs replayed) with a folder set writes
    its prefill and round; once the process forgets them (new compiled functions, dynamo reset), a new
    Session of the same plan decodes from the files (nothing is traced or compiled), and its tokens are the
    eager Session's, which are autoregressive decoding's."""
    gpu_session_on_the_cpu(monkeypatch, lambda fn: "inductor")
    compiled_round.cache_clear()
    torch._dynamo.reset()
    cfg = TreeConfig(total_tokens=12, depth=4, top_k=3)
    eng = _engine("eagle", tiny_llama)
    prompt = random_prompt(3, 128)
    expected, _ = decode_all(make_session(tree=cfg, engine=Engine(tiny_llama, None)), prompt, 24)

    def compiled_session():
        session = make_session(tree=cfg, engine=eng, graphs=True, compile=True, attention="sdpa")
        session.use_graph, session.compile, session.attention = True, True, "sdpa"  # a GPU session's
        return session

    try:
        with torch._inductor.config.patch(cpu_kernels()), warnings.catch_warnings():
            warnings.simplefilter("error", UserWarning)  # a function that could not be saved warns: fail
            first, stats = decode_all(compiled_session(), prompt, 24)
            assert stats.mode == "compiled"
            saved = sorted(folder.rglob("*.pt"))
            assert {p.parent.parent.name for p in saved} == {"prefill", "run_round"}, saved
            compiled_round.cache_clear()
            compiled_prefill.cache_clear()
            torch._dynamo.reset()
            with monkeypatch.context() as m:  # nothing traced or compiled: both functions come from the files
                m.setattr(precompiled.Precompiled, "_compile", lambda *a: pytest.fail("compiled again"))
                frames = counters["frames"]["total"]
                second, stats = decode_all(compiled_session(), prompt, 24)
                assert counters["frames"]["total"] == frames
            assert stats.mode == "compiled"
        assert sorted(folder.rglob("*.pt")) == saved  # and nothing new was written
        assert first == second == expected
    finally:
        compiled_prefill.cache_clear()
        compiled_round.cache_clear()
        torch._dynamo.reset()


def test_a_function_that_cannot_be_packaged_compiles_lazily_and_later_processes_skip_the_attempt(folder, monkeypatch):
    """A graph break (fullgraph capture fails): the call runs the lazily compiled function, with one warning
    that names the reason, which is kept for the next process of the same code; that process goes straight
    to lazy compilation."""
    if not precompiled.supported():
        pytest.skip("this torch cannot save compiled functions")
    calls = []

    def breaks(x):
        torch._dynamo.graph_break()
        return x + 1

    def lazy(x):
        calls.append(x)
        return x + 1

    fn = precompiled.Precompiled(breaks, "breaks", False, lazy, lambda *a: "v")
    with pytest.warns(UserWarning, match="compiled without saving it"):
        assert fn(torch.zeros(2)).tolist() == [1.0, 1.0]
    marker = folder / precompiled.environment() / "breaks" / "v" / precompiled.UNPACKABLE
    assert marker.is_file() and len(calls) == 1
    again = precompiled.Precompiled(breaks, "breaks", False, lazy, lambda *a: "v")  # a later process
    with monkeypatch.context() as m, warnings.catch_warnings():
        warnings.simplefilter("error")
        m.setattr(torch, "compile", lambda *a, **k: pytest.fail("tried to package again"))
        assert again(torch.ones(2)).tolist() == [2.0, 2.0]
    assert len(calls) == 2 and not list(marker.parent.glob("*.pt"))


@needs_packaging
@pytest.mark.filterwarnings("ignore:.*flex_attention.*")
def test_a_function_that_calls_flex_attention_loads_back(folder, monkeypatch):
    """A function that attends through FlexAttention (``attention.attend`` with a BlockMask whose mask closes
    over a tensor, as a compiled round's tree attention does) is saved, and a later process loads it and runs
    it without compiling: dynamo flattens FlexAttention's arguments with pytree, so the saved guards name
    pytree's node registry through an import, which only loads within a tracing context
    (``precompiled.load``)."""
    from torch.nn.attention.flex_attention import BlockMask

    from fsd_eagle.attention import attend

    def attend_under_mask(q, k, v, dense):
        def mask_mod(b, h, q_idx, kv_idx):
            return dense[q_idx, kv_idx]

        ones = torch.ones(1, 1, 1, dtype=torch.int32)
        index = torch.zeros(1, 1, 1, 1, dtype=torch.int32)
        mask = BlockMask.from_kv_blocks(ones, index, BLOCK_SIZE=128, mask_mod=mask_mod, seq_lengths=(128, 128),
                                        compute_q_blocks=False)
        return attend(q, k, v, mask)

    def fresh():  # as in a new process: nothing loaded yet
        return precompiled.Precompiled(attend_under_mask, "attend", False, torch.compile(attend_under_mask),
                                       lambda *a: "v")

    q, k, v = torch.randn(3, 1, 1, 128, 16)
    dense = torch.ones(128, 128, dtype=torch.bool).tril()
    with torch._inductor.config.patch(cpu_kernels("flex")):
        first = fresh()(q, k, v, dense)
        saved = sorted(folder.rglob("*.pt"))
        assert len(saved) == 1
        with monkeypatch.context() as m, warnings.catch_warnings():
            warnings.filterwarnings("error", message=".*compiles again")  # a file it cannot load: fail
            m.setattr(precompiled.Precompiled, "_compile", lambda *a: pytest.fail("compiled again"))
            again = fresh()(q, k, v, dense)
    assert sorted(folder.rglob("*.pt")) == saved
    torch.testing.assert_close(again, first)


def ours(caplog) -> list:
    return [r for r in caplog.records if r.name == precompiled.log.name]


@needs_packaging
def test_a_saved_specialization_that_does_not_fit_is_logged_with_the_guard_that_failed(folder, caplog):
    """A later process (a new Precompiled on the same folder) whose arguments the saved specialization's guards
    reject compiles a new one, and says at debug level which guard rejected the old one: what tells why a
    restart compiles again."""
    def double(x):
        return x * 2

    def fresh():
        return precompiled.Precompiled(double, "double", False, torch.compile(double), lambda *a: "v")

    with torch._inductor.config.patch(cpu_kernels()):
        assert fresh()(torch.ones(3)).tolist() == [2.0] * 3
        with caplog.at_level("DEBUG", logger="fsd_eagle.precompiled"):
            assert fresh()(torch.ones(3)).tolist() == [2.0] * 3  # loaded: fits, nothing logged
            assert not ours(caplog)
            assert fresh()(torch.ones(2, 5)).sum().item() == 20.0  # another shape: a new specialization
    saved = list((folder / precompiled.environment() / "double" / "v").glob("*.pt"))
    assert len(saved) == 2
    [record] = ours(caplog)
    assert "saved specialization 1 of 1" in record.getMessage() and "L['x']" in record.getMessage(), record.getMessage()


def test_a_failure_is_summed_up_in_one_line_with_where_it_arose():
    error = RuntimeError('Unsupported context manager\n  Hint: ...\n\nfrom user code:\n   File "a.py", line 3, in f\n'
                         '    g()\n  File "b.py", line 9, in g\n    with lock:')
    assert precompiled.summary(error) == 'RuntimeError: Unsupported context manager at File "b.py", line 9, in g'
    assert precompiled.summary(ValueError("bad")) == "ValueError: bad"


def test_the_triton_kernels_are_found_by_their_module_and_name():
    """A saved compiled round names each Triton kernel it launches by its module and name, and a new process
    looks it up there: every kernel of fsd_eagle.kernels is an attribute of that module under its own name
    (kernels made inside a factory function were not, and a restart on a GPU compiled the round again). Needs
    Triton (GPU hosts)."""
    pytest.importorskip("triton")
    from fsd_eagle import kernels

    made = [*kernels.jit_kernels(), kernels.jit_rejection_states(), kernels.jit_pool_draw()]
    for kernel in made:
        name = kernel.fn.__name__
        assert kernel.fn.__module__ == kernels.__name__
        bound = getattr(kernels, name, None)
        assert bound is not None and bound.fn.__name__ == name, name


def saving(fn):
    """A new ``Precompiled`` of ``fn`` (static shapes, variant "v"), as a new process would make it; its lazy
    fallback fails the test."""
    return precompiled.Precompiled(fn, fn.__name__, False, lambda *a: pytest.fail("lazy fallback ran"),
                                   lambda *a: "v")


@needs_packaging
def test_loads_only_runs_what_is_saved_and_refuses_to_compile(folder, monkeypatch):
    """Under ``loads_only`` a call whose arguments a saved specialization fits runs it; one that would compile
    (another shape, no folder set, a function that cannot be packaged) raises NotSaved and compiles nothing."""
    def double(x):
        return x * 2

    def fresh():
        return saving(double)

    with torch._inductor.config.patch(cpu_kernels()):
        assert fresh()(torch.ones(3)).tolist() == [2.0] * 3  # compiled and saved, outside the mode
    with precompiled.loads_only(), monkeypatch.context() as m:
        m.setattr(torch, "compile", lambda *a, **k: pytest.fail("compiled under loads_only"))
        assert fresh()(torch.ones(3)).tolist() == [2.0] * 3  # a later process loads it
        with pytest.raises(precompiled.NotSaved, match="nothing saved"):
            fresh()(torch.ones(2, 5))
        m.setenv(precompiled.ENV, "0")
        with pytest.raises(precompiled.NotSaved, match="no folder"):
            fresh()(torch.ones(3))
    marked = precompiled.Precompiled(double, "marked", False, lambda x: x * 2, lambda *a: "v")
    (folder / precompiled.environment() / "marked" / "v").mkdir(parents=True)
    (folder / precompiled.environment() / "marked" / "v" / precompiled.UNPACKABLE).write_text("graph break\n")
    assert marked(torch.ones(1)).tolist() == [2.0]  # outside the mode: the lazy function
    with precompiled.loads_only(), pytest.raises(precompiled.NotSaved, match="cannot be packaged"):
        marked(torch.ones(1))


@needs_packaging
@pytest.mark.filterwarnings("ignore:.*flex_attention.*")
def test_a_restart_warms_a_server_configuration_from_saved_functions_alone(tiny_llama, folder, monkeypatch):
    """What a restarted server does with a recorded configuration (fsd_eagle.server.records): the warm-up of
    a batched compiled session, which met every prefill form a lane meets (rows, lengths), saved everything
    it compiled; a fresh process (compiled functions forgotten, dynamo reset) warms the same configuration
    under ``loads_only`` without a NotSaved and without tracing, and decodes as the first did. Compiled with
    dynamo's eager backend: which saved specialization fits is decided by dynamo's guards, not the backend."""
    import types

    from fsd_eagle.server.compiler import warm
    from fsd_eagle.verify import AcceptanceRule

    gpu_session_on_the_cpu(monkeypatch, lambda fn: "eager")
    compiled_round.cache_clear()
    torch._dynamo.reset()
    eng = _engine("eagle", tiny_llama)
    call = types.SimpleNamespace(prompt_ids=torch.zeros(8, dtype=torch.long), rule=AcceptanceRule())
    context, prompt = 512, random_prompt(3, 40)

    def warmed():
        session = make_session(tree=TreeConfig(total_tokens=12, depth=4, top_k=3), engine=eng, graphs=True,
                               compile=True, attention="sdpa", batch=4)
        session.use_graph, session.compile, session.attention = True, True, "sdpa"  # a GPU session's
        warm(session, call, context)
        return session

    try:
        with warnings.catch_warnings():
            warnings.simplefilter("error", UserWarning)  # a function that could not be saved warns: fail
            first = decode_all(warmed(), prompt, 16)[0]
            compiled_round.cache_clear()
            compiled_prefill.cache_clear()
            torch._dynamo.reset()
            frames = counters["frames"]["total"]
            with precompiled.loads_only():
                again = warmed()
            assert counters["frames"]["total"] == frames  # nothing traced
            assert decode_all(again, prompt, 16)[0] == first
    finally:
        compiled_prefill.cache_clear()
        compiled_round.cache_clear()
        torch._dynamo.reset()


@needs_packaging
def test_a_process_finds_specializations_another_process_saved_after_it_looked(folder, monkeypatch):
    """A server's engine thread loads a function's folder when it first builds a configuration; its compiling
    process later compiles the same function for other shapes (another batch size) into that folder. The
    engine's next build loads that file rather than compiling again on the thread that decodes."""
    def triple(x):
        return x * 3

    def fresh():
        return saving(triple)

    with torch._inductor.config.patch(cpu_kernels()):
        fresh()(torch.ones(3))  # an earlier process saved one specialization
        engine = fresh()
        assert engine(torch.ones(3)).tolist() == [3.0] * 3  # the engine looked: one file
        fresh()(torch.ones(2, 5))  # the compiling process saves another
    with precompiled.loads_only(), monkeypatch.context() as m:
        m.setattr(torch, "compile", lambda *a, **k: pytest.fail("compiled again"))
        assert engine(torch.ones(2, 5)).tolist() == [[3.0] * 5] * 2
    assert len(list((folder / precompiled.environment() / "triple" / "v").glob("*.pt"))) == 2

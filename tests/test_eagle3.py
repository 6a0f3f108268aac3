"""EAGLE-3 heads: the target's fused low/middle/high layer states as the head's input, the head's own lm_head
over a draft vocabulary (d2t / t2d), and the published EAGLE-3 checkpoint layout. Outputs stay exact
(greedy, fp32) and sampling stays lossless, alone and in batches."""

from __future__ import annotations

import functools
import json
from collections import Counter

import pytest
import torch

import fsd_eagle.decode as decode_module
import fsd_eagle.verify as verify_module
from fsd_eagle.config import SamplingConfig, TreeConfig
from fsd_eagle.engine import Engine
from fsd_eagle.errors import ConfigError, HeadMismatchError, ModelLoadError
from fsd_eagle.head import EagleHead, HeadConfig
from fsd_eagle.models import load_head, save_head
from fsd_eagle.schedule import Request, Scheduler
from fsd_eagle.session import Plan, Session
from fsd_eagle.target import Target
from fsd_eagle.verify import AcceptanceRule

from conftest import CHI_ROWS, chi_square_pvalue, decode_all, make_session, reference_probs, sample_pairs_on, tiny_model

CPU = torch.device("cpu")
GREEDY = AcceptanceRule()
TREE = TreeConfig(total_tokens=12, depth=4, top_k=3)
DRAFT_VOCAB = 100  # of the tiny models' 128 tokens


def eagle3_head(config, draft_vocab: int = DRAFT_VOCAB, seed: int = 2, **overrides) -> EagleHead:
    """A random eagle3 head for ``config``; with ``draft_vocab`` < the vocabulary, its columns are a random
    (sorted) subset of the target's tokens, mapped by d2t / t2d."""
    torch.manual_seed(seed)
    head = EagleHead(HeadConfig.for_target(config, arch="eagle3", draft_vocab_size=draft_vocab, **overrides))
    head = head.float().eval()
    if draft_vocab < config.vocab_size:
        gen = torch.Generator().manual_seed(seed)
        ids = torch.randperm(config.vocab_size, generator=gen)[:draft_vocab].sort().values
        head.d2t.copy_(ids - torch.arange(draft_vocab))
        head.t2d.copy_(torch.zeros(config.vocab_size, dtype=torch.bool).index_fill_(0, ids, True))
    return head


@functools.lru_cache(maxsize=None)
def engine(arch: str) -> Engine:
    """A 4-layer tiny ``arch`` target with a random eagle3 head (default layers (1, 2, 2))."""
    model = tiny_model(arch, num_layers=4, max_position_embeddings=1024)
    return Engine(model, None, head=eagle3_head(model.config))


@torch.no_grad()
def greedy_reference(model, prompt: torch.Tensor, n: int) -> list[int]:
    """Plain autoregressive greedy decoding with full forwards (no cache)."""
    ids = prompt.clone()
    for _ in range(n):
        ids = torch.cat([ids, model(ids[None]).logits[0, -1].argmax().view(1)])
    return ids[prompt.shape[0]:].tolist()


def prompts(n: int, vocab: int, seed: int = 0) -> list[torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    return [torch.randint(0, vocab, (int(torch.randint(3, 30, (1,), generator=gen)),), generator=gen)
            for _ in range(n)]


def test_default_layers_and_config_checks(tiny_llama):
    cfg = HeadConfig.for_target(tiny_model("llama", num_layers=32).config, arch="eagle3")
    assert cfg.layers == (2, 16, 29) and cfg.draft_vocab_size == cfg.vocab_size
    for bad in (dict(arch="eagle4"), dict(arch="eagle3", layers=[-1]), dict(layers=[1]),
                dict(arch="eagle3", draft_vocab_size=10 ** 6)):
        with pytest.raises(ConfigError) as info:
            HeadConfig.for_target(tiny_llama.config, **bad)
        assert "\n" not in str(info.value)


def test_the_target_keeps_hidden_states_only_for_an_eagle3_drafter():
    eng = engine("llama")
    plain = Target(eng.model)
    plain.allocate(64)
    assert plain.feature_layers == () and plain.prefill(torch.arange(5)[None]).shape == (1, 5, 64)
    session = make_session(engine=eng, tree=TREE)
    assert session.target.feature_layers == (1, 2, 2)
    session.target.allocate(64)
    features = session.target.prefill(torch.arange(5)[None])
    hs = eng.model.model(torch.arange(5)[None], output_hidden_states=True).hidden_states
    torch.testing.assert_close(features, torch.cat([hs[-1], hs[1], hs[2], hs[2]], -1))


@pytest.mark.parametrize("arch", ["llama", "gemma3"])
def test_a_first_forward_that_captures_layers_traces_into_one_graph(arch):
    """A Target that carries captured layers has transformers' capture hooks in place before its first
    forward: a compiled prefill that is the model's very first forward traces into one graph (transformers
    installs them lazily under a lock that dynamo cannot trace: a compiled function with that break cannot
    be saved whole, fsd_eagle.precompiled), and gives the eager prefill's features."""
    model = tiny_model(arch, seed=7)  # a fresh model: no forward has run on it
    compiled, eager = Target(model), Target(model)
    for target in (compiled, eager):
        target.capture((0, 1))
        target.allocate(64)
    prompt = torch.arange(5)[None]
    features = torch.compile(compiled.prefill, fullgraph=True, backend="eager")(prompt)
    torch.testing.assert_close(features, eager.prefill(prompt))


@pytest.mark.parametrize("arch", ["llama", "gemma3"])
def test_eagle3_head_decodes_greedy_exactly_alone_and_batched(arch):
    eng = engine(arch)
    texts = prompts(4, 128)
    refs = [greedy_reference(eng.model, p, 16) for p in texts]
    for tree in (TREE, TreeConfig(total_tokens=5, depth=4, top_k=1)):
        out, _ = decode_all(make_session(engine=eng, tree=tree), texts[0], 16)
        assert out == refs[0]
    scheduler = Scheduler(Session(eng, Plan(TREE, GREEDY.form, batch=3)),
                          [Request(p, 16, GREEDY) for p in texts], 3)
    got: list[list[int]] = [[] for _ in texts]
    for i, tokens in scheduler.run():
        got[i] += tokens
    assert [g[:16] for g in got] == refs


@torch.no_grad()
def reference_logits(head: EagleHead, model, committed: torch.Tensor, path_tokens: torch.Tensor) -> torch.Tensor:
    """The head's draft logits ``[V_d]`` after committed + path (root first), with no cache: row t reads
    (e(x_{t+1}), a_t), a_t = fc of the target's layer states for t < L, else the head's own output at t - 1."""
    L = committed.shape[0]
    seq = torch.cat([committed, path_tokens])
    hs = model.model(seq[None, :L], output_hidden_states=True).hidden_states
    feats = list(head.fc(torch.cat([hs[i][0] for i in head.config.layers], -1)))
    embed = model.get_input_embeddings()
    out = None
    for rows in range(L, L + path_tokens.shape[0]):
        out = head(embed(seq[1: rows + 1])[None], torch.stack(feats)[None], torch.arange(rows)[None])[0, -1]
        feats.append(out)
    return head.lm_head(head.norm(out))


@torch.no_grad()
@pytest.mark.parametrize("arch", ["llama", "gemma3"])
def test_drafted_logits_match_a_plain_forward_of_the_head(arch, monkeypatch):
    """Every expanded node's q (over every token: the draft distribution on its target ids, -inf elsewhere)
    equals the head run from scratch on the fused features over prefix + node path, over several rounds."""
    from fsd_eagle.schedule import decode

    eng = engine(arch)
    head, model = eng.head, eng.model
    ids = torch.arange(DRAFT_VOCAB) + head.d2t
    trees = []
    real = decode_module.draft_tree
    monkeypatch.setattr(decode_module, "draft_tree", lambda *a, **kw: trees.append(real(*a, with_q=True)) or trees[-1])
    prompt = prompts(1, 128, seed=3)[0]
    generated: list[int] = []
    session = make_session(tree=TreeConfig(total_tokens=20, depth=4, top_k=3), engine=eng)
    for i, new in zip(range(4), decode(session, prompt, 200, GREEDY)):
        if i > 0:
            tree = trees[-1]
            committed = torch.cat([prompt, torch.tensor(generated[:-1], dtype=torch.long)])
            assert int(tree.tokens[0, 0]) == generated[-1]
            assert bool(head.t2d[tree.tokens[0, 1:]].all())  # drafts come from the draft vocabulary
            for n in range(tree.size):
                row = int(tree.q_row[0, n])
                if row < 0:
                    continue
                q = tree.q_logits[0, row]
                want = reference_logits(head, model, committed, tree.tokens[0][tree.anc[0, n]])
                torch.testing.assert_close(q[ids], want, atol=1e-4, rtol=1e-4)
                assert bool(torch.isneginf(q[~head.t2d]).all())
        generated += new
    assert len(trees) == 3


# ----------------------------------------------------------------------------- sampling is lossless

STAT_VOCAB = 12


@functools.lru_cache(maxsize=None)
def stat_setup():
    """A 2-layer target with a 12-token vocabulary, an eagle3 head drafting among 8 of them, a prompt, and
    the target's logits for the first token and (per first token) the second."""
    model = tiny_model("llama", vocab_size=STAT_VOCAB, hidden_size=32, num_layers=2, initializer_range=0.3, seed=3)
    head = eagle3_head(model.config, draft_vocab=8, seed=4)
    prompt = torch.tensor([1, 5, 3, 7])
    with torch.no_grad():
        first = model(prompt[None]).logits[0, -1]
        second = model(torch.cat([prompt.expand(STAT_VOCAB, -1), torch.arange(STAT_VOCAB)[:, None]], 1)).logits[:, -1]
    p1, p2 = reference_probs(first, 1.0, 1.0), reference_probs(second, 1.0, 1.0)
    exact = {(a, b): float(p1[a] * p2[a, b]) for a in range(STAT_VOCAB) for b in range(STAT_VOCAB)}
    return Engine(model, None, head=head), prompt, exact


def sample_pairs(n: int, seed: int) -> tuple[Counter, float]:
    eng, prompt, _ = stat_setup()
    rule = AcceptanceRule(SamplingConfig(temperature=1.0))
    session = make_session(tree=TreeConfig(total_tokens=4, depth=1, top_k=3), rule=rule, engine=eng, batch=CHI_ROWS)
    return sample_pairs_on(session, prompt, rule, n, seed)


def test_sampling_with_an_eagle3_head_is_lossless():
    counts, accept_rate = sample_pairs(1500, seed=0)
    assert accept_rate > 0.2
    assert chi_square_pvalue(counts, stat_setup()[2], 1500) > 1e-3


def test_the_eagle3_sampling_test_detects_a_broken_rule(monkeypatch):
    """Sampling the bonus without removing the rejected children skews the second token."""
    monkeypatch.setattr(verify_module, "_remove", lambda p, tokens, drop: p)
    counts, _ = sample_pairs(400, seed=0)
    assert chi_square_pvalue(counts, stat_setup()[2], 400) < 1e-3


def test_a_draft_vocabulary_limit_is_refused_for_an_eagle3_head():
    with pytest.raises(ConfigError, match="own vocabulary"):
        make_session(engine=engine("llama"), tree=TreeConfig(12, 4, 3, draft_vocab=50)).allocate(64)


# ----------------------------------------------------------------------------- the published layout


def published_config(target_config, layers=(0, 1, 3), draft_vocab: int = DRAFT_VOCAB, **changes) -> dict:
    c = target_config
    raw = {"architectures": ["LlamaForCausalLMEagle3"], "model_type": "llama", "hidden_size": c.hidden_size,
           "intermediate_size": c.intermediate_size, "num_attention_heads": c.num_attention_heads,
           "num_key_value_heads": c.num_key_value_heads, "vocab_size": c.vocab_size,
           "draft_vocab_size": draft_vocab, "rms_norm_eps": 1e-5, "rope_theta": 10000.0,
           "max_position_embeddings": c.max_position_embeddings, "num_hidden_layers": 1}
    if layers is not None:
        raw["eagle_config"] = {"eagle_aux_hidden_state_layer_ids": list(layers)}
    return raw | changes


def published_state(raw: dict, seed: int = 0) -> dict[str, torch.Tensor]:
    """Random weights under the published EAGLE-3 key names and shapes (written out here, not taken from our
    module): fc over 3 layers, the midlayer reading 2h, the head's norm and lm_head, d2t / t2d."""
    h, i, v, vd = raw["hidden_size"], raw["intermediate_size"], raw["vocab_size"], raw["draft_vocab_size"]
    d = h // raw["num_attention_heads"]
    kv = raw["num_key_value_heads"] * d
    shapes = {
        "fc.weight": (h, 3 * h), "midlayer.input_layernorm.weight": (h,), "midlayer.hidden_norm.weight": (h,),
        "midlayer.self_attn.q_proj.weight": (h, 2 * h), "midlayer.self_attn.k_proj.weight": (kv, 2 * h),
        "midlayer.self_attn.v_proj.weight": (kv, 2 * h), "midlayer.self_attn.o_proj.weight": (h, h),
        "midlayer.mlp.gate_proj.weight": (i, h), "midlayer.mlp.up_proj.weight": (i, h),
        "midlayer.mlp.down_proj.weight": (h, i), "midlayer.post_attention_layernorm.weight": (h,),
        "norm.weight": (h,), "lm_head.weight": (vd, h), "embed_tokens.weight": (v, h),
    }
    gen = torch.Generator().manual_seed(seed)
    state = {k: 0.1 * torch.randn(s, generator=gen) for k, s in shapes.items()}
    ids = torch.randperm(v, generator=gen)[:vd].sort().values
    state["d2t"] = ids - torch.arange(vd)
    state["t2d"] = torch.zeros(v, dtype=torch.bool).index_fill_(0, ids, True)
    return state


def write_published(folder, raw: dict, state: dict) -> None:
    from safetensors.torch import save_file

    folder.mkdir(parents=True, exist_ok=True)
    (folder / "config.json").write_text(json.dumps(raw))
    save_file(state, folder / "model.safetensors")


def test_published_eagle3_layout_loads_and_decodes(tmp_path):
    model = engine("llama").model
    raw = published_config(model.config)
    state = published_state(raw)
    write_published(tmp_path / "head", raw, state)
    head = load_head(tmp_path / "head", model.config, CPU, torch.float32)
    assert head.config.arch == "eagle3" and head.config.layers == (0, 1, 3) and head.config.rms_norm_eps == 1e-5
    loaded = head.state_dict()
    assert set(loaded) == set(state) - {"embed_tokens.weight"}
    for key, value in loaded.items():
        assert torch.equal(value, state[key]), key
    eng = Engine(model, None, head=head)
    prompt = prompts(1, 128, seed=5)[0]
    out, _ = decode_all(make_session(engine=eng, tree=TREE), prompt, 16)
    assert out == greedy_reference(model, prompt, 16)
    # Our own format keeps it (d2t / t2d as integers and booleans, whatever the weights' dtype).
    save_head(head, tmp_path / "ours")
    again = load_head(tmp_path / "ours", model.config, CPU, torch.float32)
    assert again.config == head.config and torch.equal(again.d2t, head.d2t) and torch.equal(again.t2d, head.t2d)


def test_published_eagle3_head_of_the_whole_vocabulary_needs_no_map(tmp_path):
    """Without eagle_config the layers are EAGLE-3's default; a head over the whole vocabulary may lack d2t
    and t2d (the published code drops them then)."""
    model = engine("llama").model
    raw = published_config(model.config, layers=None, draft_vocab=128)
    state = {k: v for k, v in published_state(raw).items() if k not in ("d2t", "t2d")}
    write_published(tmp_path, raw, state)
    head = load_head(tmp_path, model.config, CPU, torch.float32)
    assert head.config.layers == (1, 2, 2) and head.draft_ids() is None
    prompt = prompts(1, 128, seed=6)[0]
    out, _ = decode_all(make_session(engine=Engine(model, None, head=head), tree=TREE), prompt, 12)
    assert out == greedy_reference(model, prompt, 12)


def _wrong_layers(raw, state):
    raw["eagle_config"]["eagle_aux_hidden_state_layer_ids"] = [0, 1, 4]


def _wrong_hidden(raw, state):
    state["fc.weight"] = state["fc.weight"][:, :128].contiguous()


def _wrong_vocab(raw, state):
    raw["vocab_size"] = 120
    state["t2d"] = state["t2d"][:120]


def _wrong_map(raw, state):
    state["d2t"][-1] += 50


def _disagreeing_map(raw, state):
    state["t2d"] = ~state["t2d"]


def _wrong_lm_head(raw, state):
    state["lm_head.weight"] = state["lm_head.weight"][:90]


MISMATCHES = {"layers": (_wrong_layers, HeadMismatchError, "layers"),
              "hidden": (_wrong_hidden, HeadMismatchError, "hidden size"),
              "vocab": (_wrong_vocab, HeadMismatchError, "vocabulary"),
              "map_range": (_wrong_map, HeadMismatchError, "outside"),
              "map_disagrees": (_disagreeing_map, ModelLoadError, "disagree"),
              "lm_head": (_wrong_lm_head, HeadMismatchError, "lm_head")}


@pytest.mark.parametrize("case", sorted(MISMATCHES))
def test_an_eagle3_head_that_does_not_fit_is_refused_with_one_line(tmp_path, case):
    model = engine("llama").model
    change, error, words = MISMATCHES[case]
    raw = published_config(model.config)
    state = published_state(raw)
    change(raw, state)
    write_published(tmp_path, raw, state)
    with pytest.raises(error, match=words) as info:
        load_head(tmp_path, model.config, CPU, torch.float32)
    assert "\n" not in str(info.value)


def test_an_engine_refuses_an_eagle3_head_reading_missing_layers():
    model = engine("llama").model
    head = eagle3_head(model.config, layers=(0, 1, 7))
    with pytest.raises(HeadMismatchError, match="layers") as info:
        Engine(model, None, head=head)
    assert "\n" not in str(info.value)


@pytest.mark.parametrize("divergence", ["kl", "reverse_kl", "tv"])
def test_fuzzy_rules_run_on_an_eagle3_head(divergence):
    """q over every token puts the draft distribution on its target ids (0 elsewhere): divergences stay
    finite numbers, and a loose threshold accepts more than the exact rule."""
    from fsd_eagle.config import FuzzyConfig

    eng = engine("llama")
    prompt = prompts(1, 128, seed=7)[0]
    taus = []
    for threshold in (0.0, 50.0):
        rule = AcceptanceRule(SamplingConfig(), FuzzyConfig(threshold=threshold, divergence=divergence))
        out, stats = decode_all(make_session(engine=eng, tree=TREE, rule=rule), prompt, 16, rule)
        assert len(out) >= 16
        if threshold:
            assert stats.divergence_mean is not None and torch.isfinite(torch.tensor(stats.divergence_mean))
        taus.append(stats.tau)
    assert taus[1] > taus[0]


def test_a_tree_wider_than_the_heads_draft_vocabulary_is_refused_where_it_is_set():
    """top_k (children per node) or a pool larger than the eagle3 head's own vocabulary: a ConfigError of
    one line from set_tree, not an error inside a round; the generator keeps its tree and still decodes."""
    from fsd_eagle.api import SpeculativeGenerator
    from test_api import make_tokenizer

    model = tiny_model("llama")
    gen = SpeculativeGenerator(model, make_tokenizer(), head=eagle3_head(model.config, 16), tree=TreeConfig(8, 3, 2))
    for kwargs, words in ((dict(top_k=17), "top_k 17 exceeds the 16 tokens"), (dict(pool=20), "pool 20 exceeds")):
        with pytest.raises(ConfigError, match=words):
            gen.set_tree(8, 3, **kwargs)
    assert gen.tree == TreeConfig(8, 3, 2)
    gen.set_tree(8, 3, 16)
    assert len(gen.generate([5, 6, 7], 6).token_ids) == 6

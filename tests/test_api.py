"""Tests of the Python API (fsd_eagle.api.SpeculativeGenerator): generate / stream behaviour, statistics, and
our own one-line exceptions for bad input. Offline: tiny random Llama models and a word-level tokenizer
("w3 w17 ..." <-> ids) built with the tokenizers library."""

from __future__ import annotations

import copy
import math

import pytest
import torch

from fsd_eagle.api import GenerationResult, SpeculativeGenerator
from fsd_eagle.config import FuzzyConfig, TreeConfig
from fsd_eagle.errors import ConfigError, FSDError, HeadMismatchError, InputError, ModelLoadError
from fsd_eagle.head import EagleHead, HeadConfig
from fsd_eagle.models import save_head

torch.set_num_threads(1)  # tiny matmuls: threads only add contention

VOCAB = 128
EOS = 2
TREE = TreeConfig(total_tokens=6, depth=4, top_k=2)
PROMPT = "w5 w17 w99 w3 w42 w64 w8"


def make_llama(seed: int = 0, vocab: int = VOCAB, **overrides):
    from transformers import LlamaConfig, LlamaForCausalLM

    kw = dict(vocab_size=vocab, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
              num_key_value_heads=2, max_position_embeddings=512, initializer_range=0.1)
    kw.update(overrides)
    with torch.random.fork_rng():
        torch.manual_seed(seed)
        model = LlamaForCausalLM(LlamaConfig(**kw))
    model.generation_config.eos_token_id = None
    return model.float().eval()


def save_target_and_head(root, head_seed: int):
    """A tiny Llama target (make_llama, make_tokenizer) and a random head saved as local folders
    root/target and root/head, as users pass them to the CLI and the benchmarks."""
    model = make_llama(seed=0)
    model.save_pretrained(root / "target")
    make_tokenizer().save_pretrained(root / "target")
    with torch.random.fork_rng():
        torch.manual_seed(head_seed)
        save_head(EagleHead(HeadConfig.for_target(model.config)), root / "head", dtype=torch.float32)
    return root


def noisy_copy(model, noise: float = 0.01, seed: int = 1):
    draft = copy.deepcopy(model)
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in draft.parameters():
            p.add_(noise * torch.randn(p.shape, generator=gen))
    return draft


def make_tokenizer(vocab: int = VOCAB):
    """Word-level: <unk> 0, <s> 1, </s> 2 (EOS), then w3 .. w{vocab-1}; whitespace split; a chat template."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    words = {"<unk>": 0, "<s>": 1, "</s>": EOS}
    words.update({f"w{i}": i for i in range(3, vocab)})
    backend = Tokenizer(models.WordLevel(words, unk_token="<unk>"))
    backend.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    return PreTrainedTokenizerFast(
        tokenizer_object=backend, unk_token="<unk>", bos_token="<s>", eos_token="</s>",
        chat_template="{% for m in messages %}<s> {{ m['content'] }} {% endfor %}")


@pytest.fixture(scope="module")
def model():
    return make_llama(seed=0)


@pytest.fixture(scope="module")
def tokenizer():
    return make_tokenizer()


@pytest.fixture(scope="module")
def gen(model, tokenizer):
    """Speculative decoding with a noisy copy of the target as the draft model (accepted fairly often)."""
    return SpeculativeGenerator(model, tokenizer, draft_model=noisy_copy(model), tree=TREE)


@pytest.fixture(scope="module")
def reference(gen):
    """40 greedy tokens after PROMPT (plain decoding), with no EOS among them."""
    result = gen.generate(PROMPT, 40, autoregressive=True)
    assert result.stop_reason == "max_new_tokens" and len(result.token_ids) == 40
    assert EOS not in result.token_ids  # precondition of the length tests
    assert len(set(result.token_ids)) > 4  # varied enough for the stop-string and EOS tests
    return result


def one_line_error(info) -> str:
    msg = str(info.value)
    assert isinstance(info.value, FSDError)
    assert msg and "\n" not in msg and "Traceback" not in msg
    return msg


# ---------------------------------------------------------------------------------- generate()


def test_encode_applies_chat_template(gen, tokenizer):
    assert gen.encode(PROMPT) == [1, 5, 17, 99, 3, 42, 64, 8]
    assert gen.encode(PROMPT, chat=False) == [5, 17, 99, 3, 42, 64, 8]
    assert gen.encode([{"role": "user", "content": "w9"}]) == [1, 9]
    assert gen.encode([7, 8, 9]) == [7, 8, 9]


def test_greedy_speculative_equals_autoregressive(gen, reference):
    result = gen.generate(PROMPT, 40)
    assert result.token_ids == reference.token_ids
    assert result.text == reference.text
    assert result.text == " ".join(f"w{i}" for i in reference.token_ids)
    assert result.stats.tau > 1.2  # the draft model is accepted sometimes
    # prompts as text, chat messages and ids are the same prompt
    ids = gen.encode(PROMPT)
    assert gen.generate(ids, 40).token_ids == reference.token_ids
    assert gen.generate([{"role": "user", "content": PROMPT}], 40).token_ids == reference.token_ids


@pytest.mark.parametrize("n", [1, 2, 5, 13])
@pytest.mark.parametrize("autoregressive", [False, True])
def test_max_new_tokens_respected(gen, reference, n, autoregressive):
    result = gen.generate(PROMPT, n, autoregressive=autoregressive)
    assert result.token_ids == reference.token_ids[:n]
    assert result.stats.new_tokens == n
    assert result.stop_reason == "max_new_tokens"
    for seed in range(3):
        sampled = gen.generate(PROMPT, n, temperature=0.8, seed=seed, autoregressive=autoregressive)
        if sampled.stop_reason == "eos":  # EOS (id 2) is a possible sample
            assert len(sampled.token_ids) < n and sampled.stats.new_tokens == len(sampled.token_ids) + 1
        else:
            assert sampled.stop_reason == "max_new_tokens"
            assert len(sampled.token_ids) == n == sampled.stats.new_tokens


def test_max_new_tokens_clipped_by_context(tokenizer):
    small = make_llama(seed=0, max_position_embeddings=48)
    g = SpeculativeGenerator(small, tokenizer, tree=TREE)
    result = g.generate(PROMPT, 1000)
    n_prompt = len(g.encode(PROMPT))
    assert 1 <= len(result.token_ids) <= 48 - n_prompt
    assert result.stop_reason == "context"


def test_eos_stops(model, tokenizer, reference):
    ids = reference.token_ids
    k = next(i for i in range(3, len(ids)) if ids[i] not in ids[:i])  # first occurrence at index k >= 3
    eos_model = copy.copy(model)
    eos_model.generation_config = copy.deepcopy(model.generation_config)
    eos_model.generation_config.eos_token_id = ids[k]
    for g in (SpeculativeGenerator(eos_model, tokenizer, draft_model=noisy_copy(model), tree=TREE),
              SpeculativeGenerator(eos_model, tokenizer)):
        result = g.generate(PROMPT, 40)
        assert result.token_ids == ids[:k]
        assert result.stop_reason == "eos"
        assert result.stats.new_tokens == k + 1  # EOS counts as generated
        assert result.text == " ".join(f"w{i}" for i in ids[:k])
        assert "".join(g.stream(PROMPT, 40)) == result.text


def test_stop_strings_cut_text(gen, reference):
    words = reference.text.split()
    for stop in (words[6], " ".join(words[4:7]), [words[9], words[5]], words[0]):
        stops = [stop] if isinstance(stop, str) else stop
        cut = min(reference.text.find(s) for s in stops)
        expected = reference.text[:cut]
        for autoregressive in (False, True):
            result = gen.generate(PROMPT, 40, stop=stop, autoregressive=autoregressive)
            assert result.text == expected, (stop, autoregressive)
            assert result.stop_reason == "stop_string"
            assert not any(s in result.text for s in stops)
    result = gen.generate(PROMPT, 40, stop="not there")
    assert result.text == reference.text and result.stop_reason == "max_new_tokens"


def test_stream_concatenates_to_generate(gen, reference):
    words = reference.text.split()
    cases = [dict(), dict(autoregressive=True), dict(temperature=0.8, seed=5), dict(max_new_tokens=7),
             dict(stop=" ".join(words[3:5])), dict(stop=" ".join(words[3:5]), autoregressive=True),
             dict(stop=words[8] + " w"), dict(fuzzy=FuzzyConfig(threshold=math.inf))]
    for kwargs in cases:
        kwargs = {"max_new_tokens": 30, **kwargs}
        pieces = list(gen.stream(PROMPT, **kwargs))
        result = gen.generate(PROMPT, **kwargs)
        assert all(isinstance(p, str) and p for p in pieces)
        assert "".join(pieces) == result.text, kwargs
        if "max_new_tokens" in kwargs and not kwargs.get("stop"):
            assert len(pieces) > 1


def test_seed_makes_sampling_reproducible(gen):
    for autoregressive in (False, True):
        a = gen.generate(PROMPT, 30, temperature=0.8, seed=11, autoregressive=autoregressive)
        b = gen.generate(PROMPT, 30, temperature=0.8, seed=11, autoregressive=autoregressive)
        c = gen.generate(PROMPT, 30, temperature=0.8, seed=12, autoregressive=autoregressive)
        assert a.token_ids == b.token_ids and a.text == b.text
        assert a.token_ids != c.token_ids
        f = gen.generate(PROMPT, 30, temperature=0.8, top_p=0.9, top_k=20, seed=11, autoregressive=autoregressive)
        assert f.token_ids == gen.generate(PROMPT, 30, temperature=0.8, top_p=0.9, top_k=20, seed=11,
                                           autoregressive=autoregressive).token_ids


def test_stats_fields(gen):
    for kwargs in (dict(), dict(autoregressive=True), dict(temperature=0.8, seed=1),
                   dict(fuzzy=FuzzyConfig(threshold=0.5, divergence="js"))):
        result = gen.generate(PROMPT, 25, **kwargs)
        assert isinstance(result, GenerationResult)
        s = result.stats
        eos = result.stop_reason == "eos"
        assert s.new_tokens == len(result.token_ids) + eos == (s.new_tokens if eos else 25)
        assert 1 <= s.target_forwards <= s.new_tokens
        assert s.tau == pytest.approx(s.new_tokens / s.target_forwards)
        assert s.tokens_per_s > 0 and s.elapsed_s > 0
        d = result.to_dict()
        for key in ("text", "new_tokens", "target_forwards", "tau", "tokens_per_s", "fuzzy_accepted"):
            assert key in d
        assert d["new_tokens"] == s.new_tokens and d["target_forwards"] == s.target_forwards
        assert d["tau"] == pytest.approx(s.tau, abs=1e-4)
        assert d["text"] == result.text
        if kwargs.get("autoregressive"):
            assert s.target_forwards == 25 and s.tau == 1.0
    assert gen.generate(PROMPT, 25).stats.target_forwards < 25


# ------------------------------------------------------------------------------ bad generate input


@pytest.mark.parametrize("prompt", ["", "   ", "\n\t ", [], ()])
def test_empty_prompt(gen, prompt):
    with pytest.raises(InputError) as info:
        gen.generate(prompt, 5)
    one_line_error(info)


@pytest.mark.parametrize("prompt", [[1, VOCAB], [-1], [3, "w4"], [1.0, 2.0], [True], [None], 42])
def test_bad_prompt_ids(gen, prompt):
    with pytest.raises(InputError) as info:
        gen.generate(prompt, 5)
    one_line_error(info)


@pytest.mark.parametrize("n", [0, -1, 2.5, "3", True, None, float("inf")])
def test_bad_max_new_tokens(gen, n):
    with pytest.raises(InputError) as info:
        gen.generate(PROMPT, n)
    one_line_error(info)
    with pytest.raises(InputError):
        list(gen.stream(PROMPT, n))


def test_prompt_longer_than_context(tokenizer):
    g = SpeculativeGenerator(make_llama(seed=0, max_position_embeddings=64), tokenizer, tree=TREE)
    long_prompt = " ".join(f"w{3 + i % 100}" for i in range(80))
    for prompt in (long_prompt, list(range(3, 83))):
        with pytest.raises(InputError) as info:
            g.generate(prompt, 5)
        assert "64" in one_line_error(info)
    assert g.generate("w5 w6", 5).token_ids  # a short prompt still fits


@pytest.mark.parametrize("kwargs, error", [
    (dict(temperature=-1.0), ConfigError), (dict(temperature=float("nan")), ConfigError),
    (dict(temperature="hot"), ConfigError), (dict(top_p=0.0), ConfigError), (dict(top_p=1.5), ConfigError),
    (dict(top_k=-1), ConfigError), (dict(fuzzy="kl"), ConfigError), (dict(fuzzy=0.5), ConfigError),
    (dict(seed="abc"), InputError), (dict(seed=1.5), InputError), (dict(stop=[1]), InputError),
    (dict(stop=5), InputError),
])
def test_bad_generation_arguments(gen, kwargs, error):
    with pytest.raises(error) as info:
        gen.generate(PROMPT, 5, **kwargs)
    one_line_error(info)


def test_constructor_errors(model, tokenizer):
    head = EagleHead(HeadConfig.for_target(model.config))
    with pytest.raises(ConfigError) as info:
        SpeculativeGenerator(model, tokenizer, head=head, draft_model=noisy_copy(model))
    one_line_error(info)
    with pytest.raises(HeadMismatchError) as info:
        SpeculativeGenerator(model, tokenizer, draft_model=make_llama(seed=3, vocab=VOCAB + 8))
    one_line_error(info)
    with pytest.raises(ConfigError) as info:
        SpeculativeGenerator(model, tokenizer, head=head, tree=TreeConfig(total_tokens=10, depth=2, top_k=VOCAB + 1))
    one_line_error(info)


# ------------------------------------------------------------------------------------ load()


@pytest.fixture(scope="module")
def saved(tmp_path_factory, model, tokenizer):
    """A target folder (weights + tokenizer), a fitting random head, and heads that do not fit."""
    root = tmp_path_factory.mktemp("api_models")
    target = root / "target"
    model.save_pretrained(target)
    tokenizer.save_pretrained(target)
    with torch.random.fork_rng():
        torch.manual_seed(5)
        save_head(EagleHead(HeadConfig.for_target(model.config)), root / "head", dtype=torch.float32)
        narrow = make_llama(seed=1, hidden_size=32, intermediate_size=64).config
        save_head(EagleHead(HeadConfig.for_target(narrow)), root / "head_hidden")
        wide_vocab = make_llama(seed=1, vocab=VOCAB + 16).config
        save_head(EagleHead(HeadConfig.for_target(wide_vocab)), root / "head_vocab")
    return root


def load(saved, **kwargs):
    kwargs = {"target": saved / "target", "device": "cpu", "dtype": "float32", "tree": TREE, **kwargs}
    return SpeculativeGenerator.load(**kwargs)


def test_load_with_head_matches_autoregressive(saved, reference):
    g = load(saved, head=saved / "head")
    assert g.drafter is not None
    result = g.generate(PROMPT, 40)
    assert result.token_ids == reference.token_ids
    fuzzy = g.generate(PROMPT, 21, fuzzy=FuzzyConfig(threshold=math.inf))
    assert fuzzy.stats.tau > 2  # the head's drafts really were verified (and all accepted at T = inf)
    assert load(saved).drafter is None  # a target without --head decodes plainly
    assert load(saved).generate(PROMPT, 40).token_ids == reference.token_ids


@pytest.mark.parametrize("device", ["tpu", "cuda:x", "", "meta", pytest.param(
    "cuda", marks=pytest.mark.skipif(torch.cuda.is_available(), reason="CUDA is available here"))])
def test_load_unknown_device(saved, device):
    with pytest.raises(ConfigError) as info:
        load(saved, device=device)
    one_line_error(info)


@pytest.mark.parametrize("dtype", ["int3", "float64", "fp8", ""])
def test_load_unknown_dtype(saved, dtype):
    with pytest.raises(ConfigError) as info:
        load(saved, dtype=dtype)
    one_line_error(info)


def copy_folder(src, dst):
    import shutil

    shutil.copytree(src, dst)
    return dst


def test_load_corrupt_or_missing_head(saved, tmp_path):
    garbage = copy_folder(saved / "head", tmp_path / "garbage")
    (garbage / "model.safetensors").write_bytes(b"\x00\xffnot a safetensors file" * 7)
    truncated = copy_folder(saved / "head", tmp_path / "truncated")
    data = (truncated / "model.safetensors").read_bytes()
    (truncated / "model.safetensors").write_bytes(data[: len(data) // 2])
    no_weights = copy_folder(saved / "head", tmp_path / "no_weights")
    (no_weights / "model.safetensors").unlink()
    bad_json = copy_folder(saved / "head", tmp_path / "bad_json")
    (bad_json / "config.json").write_bytes(b"{\"hidden_size\": 64,")
    no_config = copy_folder(saved / "head", tmp_path / "no_config")
    (no_config / "config.json").unlink()
    for folder in (garbage, truncated, no_weights, bad_json, no_config, tmp_path / "missing"):
        with pytest.raises(ModelLoadError) as info:
            load(saved, head=folder)
        one_line_error(info)


@pytest.mark.parametrize("name", ["head_hidden", "head_vocab"])
def test_load_head_that_does_not_fit(saved, name):
    with pytest.raises(HeadMismatchError) as info:
        load(saved, head=saved / name)
    one_line_error(info)


def test_load_missing_target(saved, tmp_path):
    (tmp_path / "empty").mkdir()
    no_config = copy_folder(saved / "target", tmp_path / "no_config")
    (no_config / "config.json").unlink()
    bad_config = copy_folder(saved / "target", tmp_path / "bad_config")
    (bad_config / "config.json").write_text("{not json")
    a_file = tmp_path / "file.txt"
    a_file.write_text("hello")
    for folder in (tmp_path / "missing", tmp_path / "empty", no_config, bad_config, a_file):
        with pytest.raises(ModelLoadError) as info:
            load(saved, target=folder)
        one_line_error(info)
    with pytest.raises(ModelLoadError) as info:
        load(saved, draft_model=tmp_path / "missing")
    one_line_error(info)


def test_load_target_without_tokenizer(saved, tmp_path, model):
    folder = tmp_path / "weights_only"
    model.save_pretrained(folder)
    with pytest.raises(ModelLoadError) as info:
        load(saved, target=folder)
    one_line_error(info)


def test_load_target_with_corrupt_weights(saved, tmp_path):
    folder = copy_folder(saved / "target", tmp_path / "corrupt")
    (folder / "model.safetensors").write_bytes(b"garbage" * 10)
    with pytest.raises(ModelLoadError) as info:
        load(saved, target=folder)
    one_line_error(info)


# ------------------------------------------------------------------------------------------ threads


@pytest.fixture
def restore_threads():
    before = torch.get_num_threads()
    yield
    torch.set_num_threads(before)


@pytest.mark.parametrize("threads", [0, -1, 1.5, "2", True])
def test_load_bad_threads(saved, threads, restore_threads):
    with pytest.raises(ConfigError) as info:
        load(saved, threads=threads)
    assert "threads must be an integer >= 1" in one_line_error(info)


def test_load_sets_threads_once(saved, monkeypatch, restore_threads):
    """threads=N is applied with torch.set_num_threads, once, at load; on the CPU without a value the default
    (cores - 1, at most 4, at least 1) applies unless OMP_NUM_THREADS is set; on a GPU nothing changes."""
    import fsd_eagle.models as models

    calls = []
    real = torch.set_num_threads
    monkeypatch.setattr(torch, "set_num_threads", lambda n: calls.append(n) or real(n))
    g = load(saved, threads=2)
    assert calls == [2] and torch.get_num_threads() == 2
    g.generate(PROMPT, 4)
    assert calls == [2]  # not again per call

    calls.clear()
    monkeypatch.setenv("OMP_NUM_THREADS", "3")
    load(saved)
    assert calls == []  # the user's OMP_NUM_THREADS is left alone
    monkeypatch.delenv("OMP_NUM_THREADS")
    load(saved)
    assert calls == [models.default_threads()]
    calls.clear()
    assert models.set_threads(None, torch.device("cuda")) is None and calls == []
    assert models.set_threads(1, torch.device("cuda")) == 1 and calls == [1]  # explicit: applied on a GPU too


@pytest.mark.parametrize("cores, expected", [(1, 1), (2, 1), (3, 2), (5, 4), (64, 4)])
def test_default_threads_leave_a_core_free(monkeypatch, cores, expected):
    import fsd_eagle.models as models

    monkeypatch.setattr(models.os, "sched_getaffinity", lambda pid: set(range(cores)), raising=False)
    assert models.default_threads() == expected

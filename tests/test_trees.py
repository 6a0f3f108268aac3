"""Tree presets (fsd_eagle.trees_presets: lookup, batch buckets, fallbacks, SpeculativeGenerator.load's
default, the package's own presets file) and the tree tuner (trees/tune.py: grid, replayed acceptance, cost
model, pruning, choice, one end-to-end run on a tiny random model whose replayed tau must equal real
decoding's, batch buckets measured through the public API, the presets writer)."""

from __future__ import annotations

import argparse
import copy
import json
import os
import re
import stat
import sys
from pathlib import Path

import pytest
import torch

from fsd_eagle import trees_presets
from fsd_eagle.api import SpeculativeGenerator
from fsd_eagle.config import TreeConfig
from fsd_eagle.errors import ConfigError, InputError
from fsd_eagle.target import Target

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
from trees import tune  # noqa: E402

torch.set_num_threads(1)


class WordTokenizer:
    """Just what SpeculativeGenerator needs to decode token ids: no EOS, no chat template."""

    eos_token_id = None
    chat_template = None

    def decode(self, ids, skip_special_tokens=True):
        return " ".join(f"w{i}" for i in ids)


def named_model(model, name: str):
    model = copy.deepcopy(model)
    model.config._name_or_path = name
    return model


def write(tmp_path: Path, table: dict) -> Path:
    path = tmp_path / "presets.json"
    path.write_text(json.dumps(table))
    return path


TABLE = {
    "_shapes": {"chain-3": {"total_tokens": 4, "depth": 3, "top_k": 1}},
    "tiny-x": {"cpu": {"tree": {"total_tokens": 8, "depth": 3, "top_k": 2}, "measured": {"tuned": True}},
               "cuda": {"tree": "chain-3"}},
    "tiny-shape": {"cpu": {"tree": "chain-3"}},
}


# ------------------------------------------------------------------------------------------ preset lookup

def test_preset_file_entry_is_honoured(tmp_path, tiny_llama):
    path = write(tmp_path, TABLE)
    assert trees_presets.preset_tree(Target(named_model(tiny_llama, "/models/tiny-x/")), path) == TreeConfig(8, 3, 2)
    assert trees_presets.preset_tree(Target(named_model(tiny_llama, "tiny-shape")), path) == TreeConfig(4, 3, 1)
    assert trees_presets.named_shape("chain-3", path) == TreeConfig(4, 3, 1)


def test_unknown_model_device_or_missing_file_gives_defaults(tmp_path, tiny_llama):
    path = write(tmp_path, TABLE)
    assert trees_presets.preset_tree(Target(named_model(tiny_llama, "someone/else")), path) == TreeConfig()
    assert trees_presets.preset_tree(Target(tiny_llama), path) == TreeConfig()  # no name at all
    assert trees_presets.lookup(TABLE, "tiny-x", "mps") is None
    assert trees_presets.lookup(TABLE, "_shapes", "cpu") is None
    absent = tmp_path / "absent.json"
    assert trees_presets.preset_tree(Target(named_model(tiny_llama, "tiny-x")), absent) == TreeConfig()
    wildcard = dict(TABLE, **{"*": {"cpu": {"tree": {"total_tokens": 5, "depth": 4, "top_k": 1}}}})
    assert trees_presets.lookup(wildcard, "someone", "cpu") == TreeConfig(5, 4, 1)


def test_bad_preset_files_fail_with_one_line(tmp_path, tiny_llama):
    target = Target(named_model(tiny_llama, "tiny-x"))
    bad = tmp_path / "bad.json"
    for table_or_text in ("{not json", "[1, 2]", '{"_shapes": [1]}', '{"_shapes": "chain-3", "tiny-x": {"cpu": '
                                                                       '{"tree": "chain-3"}}}'):
        bad.write_text(table_or_text)
        with pytest.raises(ConfigError):
            trees_presets.preset_tree(target, bad)
    for spec in ({"total_tokens": 8, "depth": 3}, {"total_tokens": 0, "depth": 3, "top_k": 1}, "no-such-shape"):
        with pytest.raises(ConfigError):
            trees_presets.preset_tree(target, write(tmp_path, {"tiny-x": {"cpu": {"tree": spec}}}))


def test_shipped_presets_file_is_found_and_valid():
    import fsd_eagle

    # Package data, next to the module (an installed wheel has it too: tests/test_packaging.py)
    assert Path(os.fspath(trees_presets.PRESETS)) == Path(fsd_eagle.__file__).parent / "presets.json"
    assert tune.DEFAULT_OUT == ROOT / "fsd_eagle" / "presets.json"  # the tuner writes the file the package reads
    assert not (ROOT / "trees" / "presets.json").exists()
    table = trees_presets.load_presets()
    for name in table["_shapes"]:
        trees_presets.named_shape(name)
    assert trees_presets.named_shape("eagle2-default") == TreeConfig()
    assert trees_presets.named_shape("chain-6") == TreeConfig(7, 6, 1)
    entry = table["SmolLM2-135M-Instruct"]
    for device in ("cpu", "cuda"):
        assert trees_presets.lookup(table, "SmolLM2-135M-Instruct", device) is not None
        assert "tuned" in entry[device]["measured"]
        for b in (1, 2, 8, 64):  # every bucket of the shipped file resolves
            trees_presets.lookup_preset(table, "SmolLM2-135M-Instruct", device, b)


def test_preset_tree_reads_the_package_data_by_default(tiny_llama):
    """No path given: the package's presets answer for the shipped target's name (here a tiny model filed
    under that name), whatever the working directory."""
    table = trees_presets.load_presets()
    target = Target(named_model(tiny_llama, "/anywhere/SmolLM2-135M-Instruct"))
    assert trees_presets.preset_tree(target) == trees_presets.lookup(table, "SmolLM2-135M-Instruct", "cpu")
    assert trees_presets.preset_tree(target) == trees_presets.tree_from_spec(
        table["SmolLM2-135M-Instruct"]["cpu"]["tree"], table)


def test_load_uses_the_preset_unless_a_tree_is_given(tmp_path, monkeypatch, tiny_llama):
    import fsd_eagle.api as api

    model = named_model(tiny_llama, str(tmp_path / "tiny-x"))
    monkeypatch.setattr(api, "load_target", lambda path, device, dtype, tp_size=1: (model, WordTokenizer()))
    monkeypatch.setattr(trees_presets, "PRESETS", write(tmp_path, TABLE))
    assert SpeculativeGenerator.load(target=tmp_path / "tiny-x", device="cpu").tree == TreeConfig(8, 3, 2)
    given = TreeConfig(6, 2, 3)
    assert SpeculativeGenerator.load(target=tmp_path / "tiny-x", device="cpu", tree=given).tree == given
    monkeypatch.setattr(trees_presets, "PRESETS", tmp_path / "absent.json")
    assert SpeculativeGenerator.load(target=tmp_path / "tiny-x", device="cpu").tree == TreeConfig()


# ------------------------------------------------------------------------------------------ batch buckets

BATCHED = {
    "tiny-x": {"cpu": {"tree": {"total_tokens": 8, "depth": 3, "top_k": 2}, "measured": {"tuned": True},
                       "batch": {"4": {"tree": {"total_tokens": 4, "depth": 2, "top_k": 2}},
                                 "16": {"tree": "autoregressive", "measured": {"tokens_per_s": 9.0}},
                                 "64": {"tree": "chain-3"}}}},
    "only-batch": {"cpu": {"batch": {"8": {"tree": "autoregressive"}, "32": {"tree": "chain-3"}}}},
    "*": {"cpu": {"tree": {"total_tokens": 5, "depth": 4, "top_k": 1}}},
    "_shapes": TABLE["_shapes"],
}


def test_batch_buckets_pick_the_largest_bucket_at_most_the_batch_size(tmp_path, tiny_llama):
    Preset = trees_presets.Preset
    t8, t4, chain = TreeConfig(8, 3, 2), TreeConfig(4, 2, 2), TreeConfig(4, 3, 1)
    want = {1: Preset(t8, False, 1), 3: Preset(t8, False, 1), 4: Preset(t4, False, 4), 15: Preset(t4, False, 4),
            16: Preset(t4, True, 16), 63: Preset(t4, True, 16), 64: Preset(chain, False, 64),
            1000: Preset(chain, False, 64)}
    for b, expected in want.items():
        assert trees_presets.lookup_preset(BATCHED, "tiny-x", "cpu", b) == expected, b
    assert trees_presets.batch_bucket(1) == 1 and trees_presets.batch_bucket(48) == 32
    assert trees_presets.batch_bucket(200) == 64
    # A device entry with only "batch": bucket 1 is the defaults; the "*" model answers for others
    assert trees_presets.lookup_preset(BATCHED, "only-batch", "cpu", 4) == Preset(TreeConfig(), False, 1)
    assert trees_presets.lookup_preset(BATCHED, "only-batch", "cpu", 8) == Preset(TreeConfig(), True, 8)
    assert trees_presets.lookup_preset(BATCHED, "only-batch", "cpu", 40) == Preset(chain, False, 32)
    assert trees_presets.lookup_preset(BATCHED, "other", "cpu", 16) == Preset(TreeConfig(5, 4, 1), False, 1)
    assert trees_presets.lookup_preset(BATCHED, "tiny-x", "cuda", 16) is None
    # An autoregressive bucket's tree skips smaller buckets that do not draft either
    ar_below = {"_shapes": {"ar": {"total_tokens": 1, "depth": 1, "top_k": 1}},
                "m": {"cpu": {"tree": "ar", "batch": {"2": {"tree": "chain-3"}, "4": {"tree": "ar"},
                                                      "8": {"tree": "autoregressive"}}}}}
    ar_below["_shapes"].update(TABLE["_shapes"])
    assert trees_presets.lookup_preset(ar_below, "m", "cpu", 8) == Preset(chain, True, 8)
    assert trees_presets.lookup_preset(ar_below, "m", "cpu", 4) == Preset(chain, True, 4)  # a 1-token tree: AR
    assert trees_presets.lookup_preset(ar_below, "m", "cpu", 1) == Preset(TreeConfig(1, 1, 1), True, 1)
    # preset() says whether to draft; preset_tree() folds an autoregressive preset into total_tokens 1
    path = write(tmp_path, BATCHED)
    target = Target(named_model(tiny_llama, "tiny-x"))
    assert trees_presets.preset_tree(target, path) == t8  # the existing call: batch size 1
    assert trees_presets.preset_tree(target, path, batch_size=5) == t4
    assert trees_presets.preset(target, path, batch_size=16) == Preset(t4, True, 16)
    ar = trees_presets.preset_tree(target, path, batch_size=16)
    assert ar == TreeConfig(1, 1, 1) and not ar.drafts
    assert trees_presets.preset_for("tiny-x", "cpu", path, batch_size=64) == chain
    assert trees_presets.preset_entry("nobody", "mps", path, batch_size=8) == Preset()
    # Files without "batch" answer the same for any batch size
    assert trees_presets.lookup_preset(TABLE, "tiny-x", "cpu", 32) == Preset(t8, False, 1)


def test_bad_batch_entries_and_batch_sizes_fail_with_one_line():
    plain = {"tree": {"total_tokens": 8, "depth": 3, "top_k": 2}}
    for batch in ({"3": plain}, {"1": plain}, {"128": plain}, {"x": plain}, {"8": {"measured": {}}}, {"8": "ar"},
                  ["8"], {"8": {"tree": "no-such-shape"}}):
        with pytest.raises(ConfigError) as e:
            trees_presets.lookup_preset({"m": {"cpu": dict(plain, batch=batch)}}, "m", "cpu", 8)
        assert "\n" not in str(e.value)
    with pytest.raises(ConfigError, match="only a batch bucket"):
        trees_presets.lookup_preset({"m": {"cpu": {"tree": "autoregressive"}}}, "m", "cpu")
    for size in (0, -1, 2.0, "8", True, None):
        with pytest.raises(InputError):
            trees_presets.lookup_preset(BATCHED, "tiny-x", "cpu", size)


SAMPLED = {
    "tiny-x": {"cpu": {"tree": {"total_tokens": 8, "depth": 3, "top_k": 2},
                       "sampling": {"tree": {"total_tokens": 6, "depth": 2, "top_k": 3}, "measured": {"temperature": 0.7}},
                       "batch": {"4": {"tree": {"total_tokens": 4, "depth": 2, "top_k": 2}, "sampling": {"tree": "chain-3"}},
                                 "16": {"tree": "chain-3"}}}},
    "_shapes": TABLE["_shapes"],
}


def test_sampling_presets_apply_to_calls_that_sample(tmp_path, monkeypatch, tiny_llama):
    """An entry's "sampling" tree serves calls at temperature > 0 at its bucket (greedy calls keep "tree"; a
    bucket without one serves both); the generator's sessions follow it while the tree follows the presets,
    and explicit trees (constructor, or every value given to set_tree) are used for every call."""
    t8, t6, t4, chain = TreeConfig(8, 3, 2), TreeConfig(6, 2, 3), TreeConfig(4, 2, 2), TreeConfig(4, 3, 1)
    for b, greedy, sampled in ((1, t8, t6), (3, t8, t6), (4, t4, chain), (16, chain, chain)):
        assert trees_presets.lookup_preset(SAMPLED, "tiny-x", "cpu", b).tree == greedy, b
        assert trees_presets.lookup_preset(SAMPLED, "tiny-x", "cpu", b, sampling=True).tree == sampled, b
    assert trees_presets.lookup_preset(BATCHED, "tiny-x", "cpu", 1, sampling=True).tree == t8  # none: the same
    import fsd_eagle.api as api

    model = named_model(tiny_llama, str(tmp_path / "tiny-x"))
    monkeypatch.setattr(api, "load_target", lambda path, device, dtype, tp_size=1: (model, WordTokenizer()))
    monkeypatch.setattr(trees_presets, "PRESETS", write(tmp_path, SAMPLED))
    gen = SpeculativeGenerator.load(target=tmp_path / "tiny-x", device="cpu", random_head=True)
    assert gen.tree == t8
    assert gen.session().plan.tree == t8 and gen.session(temperature=0.7).plan.tree == t6
    assert gen.session(temperature=0.7, batch=4).plan.tree == chain and gen.session(batch=4).plan.tree == t4
    assert (gen.tree_for(), gen.tree_for(0.7), gen.tree_for(0.7, batch=5)) == (t8, t6, chain)
    r = gen.generate([5, 17, 99, 3], 6, temperature=0.7, seed=1)
    assert r.stats.new_tokens == 6
    gen.set_tree(depth=2)  # one value given: the presets still answer, with it
    assert gen.session(temperature=0.7).plan.tree == t6 and gen.session().plan.tree == TreeConfig(8, 2, 2)
    gen.set_tree(5, 2, 2)  # every value given: that tree for every call
    assert gen.session(temperature=0.7).plan.tree == TreeConfig(5, 2, 2) == gen.session().plan.tree
    fixed = SpeculativeGenerator.load(target=tmp_path / "tiny-x", device="cpu", random_head=True, tree=t4)
    assert fixed.session(temperature=0.7).plan.tree == t4
    bad = {"tiny-x": {"cpu": {"tree": {"total_tokens": 8, "depth": 3, "top_k": 2}, "sampling": {"measured": {}}}}}
    with pytest.raises(ConfigError, match="needs a \"tree\"") as e:
        trees_presets.lookup_preset(bad, "tiny-x", "cpu")  # refused for greedy calls too
    assert "\n" not in str(e.value)
    with pytest.raises(ConfigError, match="only a batch bucket"):
        trees_presets.lookup_preset({"m": {"cpu": {"sampling": {"tree": "autoregressive"}}}}, "m", "cpu", sampling=True)


def test_write_preset_per_bucket_keeps_the_rest_and_replaces_atomically(tmp_path):
    path = write(tmp_path, TABLE)
    path.chmod(0o644)
    small = {"tree": {"total_tokens": 4, "depth": 2, "top_k": 2}, "measured": {"tuned": True, "batch_size": 8}}
    tune.write_preset(path, "tiny-x", "cpu", {"tree": "autoregressive", "measured": {"tuned": True}}, bucket=32)
    tune.write_preset(path, "tiny-x", "cpu", small, bucket=8)
    table = json.loads(path.read_text())
    assert list(table["tiny-x"]["cpu"]["batch"]) == ["8", "32"]  # in bucket order
    assert table["tiny-x"]["cpu"]["tree"] == TABLE["tiny-x"]["cpu"]["tree"]  # the bucket-1 entry is kept
    plain = {"tree": {"total_tokens": 5, "depth": 4, "top_k": 1}, "measured": {"tuned": True}}
    tune.write_preset(path, "tiny-x", "cpu", plain)  # re-tuning bucket 1 keeps the batch buckets
    tune.write_preset(path, "new-model", "cuda", small, bucket=16)
    table = json.loads(path.read_text())
    assert table["tiny-x"]["cpu"] == {**plain, "batch": {"8": small, "32": {"tree": "autoregressive",
                                                                             "measured": {"tuned": True}}}}
    assert table["tiny-x"]["cuda"] == TABLE["tiny-x"]["cuda"] and table["_shapes"] == TABLE["_shapes"]
    assert trees_presets.lookup_preset(table, "tiny-x", "cpu", 40) == trees_presets.Preset(TreeConfig(4, 2, 2), True, 32)
    assert trees_presets.lookup_preset(table, "new-model", "cuda", 16) == trees_presets.Preset(TreeConfig(4, 2, 2), False, 16)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["presets.json"]  # no temporary file left
    assert stat.S_IMODE(path.stat().st_mode) == 0o644
    with pytest.raises(ConfigError):
        tune.write_preset(path, "tiny-x", "cpu", small, bucket=3)
    fresh = tmp_path / "sub" / "fresh.json"
    fresh.parent.mkdir()
    tune.write_preset(fresh, "m", "cpu", small, bucket=8)
    assert json.loads(fresh.read_text()) == {"m": {"cpu": {"batch": {"8": small}}}}


def test_batch_candidates_and_arguments():
    assert tune.smaller_trees(TreeConfig(64, 6, 8, 16384)) == [TreeConfig(32, 5, 8, 16384), TreeConfig(16, 4, 8, 16384)]
    assert tune.smaller_trees(TreeConfig(4, 2, 4, 8192), 3) == [TreeConfig(2, 1, 1, 8192)]
    assert tune.smaller_trees(TreeConfig(7, 6, 1)) == [TreeConfig(3, 2, 1)]
    assert tune.batch_candidates(TreeConfig(8, 3, 2), [TreeConfig(4, 2, 2), TreeConfig(6, 2, 3)]) == [
        tune.AR, TreeConfig(8, 3, 2), TreeConfig(4, 2, 2), TreeConfig(2, 1, 1), TreeConfig(6, 2, 3)]
    assert [tune.batch_prompt_count(b, 4, 1) for b in (1, 2, 3, 8, 32)] == [4, 4, 6, 8, 32]
    assert [tune.batch_prompt_count(b, 4) for b in (1, 2, 3, 8, 32)] == [4, 8, 12, 32, 128]
    assert tune.batch_prompt_count(3, 13, 2) == 15
    assert tune._buckets("32,1,8,8") == (1, 8, 32)
    for bad in ("3", "0", "128", "1,x", ""):
        with pytest.raises(argparse.ArgumentTypeError, match="batch sizes"):
            tune._buckets(bad)


def test_batch_entry_picks_the_fastest_autoregressive_included():
    a, b = TreeConfig(8, 3, 2), TreeConfig(4, 2, 2)
    rows = [{"tree": tune.AR, "tokens_per_s": 50.0, "tau": 1.0}, {"tree": a, "tokens_per_s": 40.0, "tau": 3.0},
            {"tree": b, "tokens_per_s": 45.0, "tau": 2.0}]
    entry = tune.batch_entry(rows, 32, "64 prompts")
    assert entry["tree"] == "autoregressive" and entry["measured"]["speedup_vs_ar"] == 1.0
    assert [c["tree"] for c in entry["measured"]["candidates"]] == ["ar", "8/3/2", "4/2/2"]
    rows[2]["tokens_per_s"] = 60.0
    entry = tune.batch_entry(rows, 8, "8 prompts")
    assert entry["tree"] == b.to_dict() and entry["measured"]["speedup_vs_ar"] == 1.2
    assert entry["measured"]["batch_size"] == 8 and entry["measured"]["tokens_per_s"] == 60.0
    # a tree that beats AR by less than the margin (default 1.05) is not worth drafting
    rows[2]["tokens_per_s"] = 51.0
    entry = tune.batch_entry(rows, 64, "64 prompts")
    assert entry["tree"] == "autoregressive" and entry["measured"]["speedup_vs_ar"] == 1.0
    assert "at least 1.05x" in entry["measured"]["validation"]
    assert tune.batch_entry(rows, 64, "64 prompts", min_speedup=1.0)["tree"] == b.to_dict()
    assert tune.fastest(rows[1:], 2.0) is rows[2]  # without an AR row, the fastest tree
    with pytest.raises(ValueError):
        tune.fastest([])


def test_tune_batch_measures_every_candidate_through_generate(tiny_llama, monkeypatch):
    """Each candidate decodes every prompt through gen.generate(prompts, batch_size=B); AR as
    autoregressive=True; the trees through set_tree; every prompt's tokens are counted."""
    gen = SpeculativeGenerator(tiny_llama, WordTokenizer(), draft_model=tiny_llama)  # self-draft: all accepted
    calls = []
    real = gen.generate

    def spy(prompts, **kw):
        calls.append((len(prompts), kw["batch_size"], kw["autoregressive"], gen.tree.label))
        return real(prompts, **kw)

    monkeypatch.setattr(gen, "generate", spy)
    prompts = [[5, 17, 99, 3, 42], [7, 7, 30, 101], [90, 4, 56, 23], [1, 2, 3]]
    candidates = tune.batch_candidates(TreeConfig(8, 3, 2))
    entry = tune.tune_batch(gen, prompts, candidates, 2, max_new_tokens=6, repeats=2, log=lambda msg: None)
    assert len(calls) == 2 * len(candidates) and all(c[:2] == (4, 2) for c in calls)
    assert {(c[2], c[3]) for c in calls if not c[2]} == {(False, t.label) for t in candidates if t.drafts}
    m = entry["measured"]
    rows = {r["tree"]: r for r in m["candidates"]}
    assert set(rows) == {"ar", "8/3/2", "4/2/2", "2/1/1"}
    assert all(r["new_tokens"] == 2 * 4 * 6 for r in rows.values())  # no EOS: every prompt to max_new_tokens
    assert rows["ar"]["tau"] == 1.0 and rows["8/3/2"]["tau"] > rows["2/1/1"]["tau"] > 1.0
    best = max(rows, key=lambda k: rows[k]["tokens_per_s"])
    if rows[best]["tokens_per_s"] < tune.MIN_BATCH_SPEEDUP * rows["ar"]["tokens_per_s"]:
        best = "ar"  # a tree must beat plain decoding by MIN_BATCH_SPEEDUP (timing: either may happen here)
    assert entry["tree"] == ("autoregressive" if best == "ar" else TreeConfig.parse(best).to_dict())
    assert m["tuned"] and m["batch_size"] == 2 and m["tokens_per_s"] == rows[best]["tokens_per_s"]


# ------------------------------------------------------------------------------------------ tuner logic

def test_candidate_grid_keeps_distinct_reachable_trees():
    grid = tune.candidate_grid((4, 8, 96), (1, 3, 7), (1, 4))
    assert len(grid) == len(set(grid))
    for c in grid:
        assert c.total_tokens == tune.tree_size(c.total_tokens, c.depth, c.top_k) and c.depth <= c.total_tokens - 1
    chains = {c for c in grid if c.top_k == 1}
    assert chains == {TreeConfig(2, 1, 1), TreeConfig(4, 3, 1), TreeConfig(8, 7, 1)}
    assert TreeConfig(5, 1, 4) in grid and TreeConfig(4, 1, 4) in grid  # 8 and 96 nodes cap at 1 + 4 at depth 1
    assert TreeConfig(37, 3, 4) in grid and TreeConfig(96, 7, 4) in grid
    assert not any(c.depth == 7 and c.total_tokens == 4 for c in grid)  # too few nodes to reach depth 7
    assert tune.tree_size(60, 6, 10) == 60 and tune.tree_size(60, 2, 4) == 21
    # top_k >= total_tokens - 1 draws the same tree as any larger top_k: only the smallest is kept
    assert tune.candidate_grid((8,), (2,), (4, 8, 10)) == [TreeConfig(8, 2, 4), TreeConfig(8, 2, 8)]
    assert tune.candidate_grid((4,), (1,), (4, 8, 10)) == [TreeConfig(4, 1, 4)]


def test_a_larger_top_k_beyond_total_tokens_draws_the_same_tree(tiny_llama):
    from fsd_eagle.drafter import EagleDrafter
    from fsd_eagle.head import EagleHead, HeadConfig
    from fsd_eagle.tree import draft_tree

    target = Target(tiny_llama)
    torch.manual_seed(0)
    drafter = EagleDrafter(EagleHead(HeadConfig.for_target(tiny_llama.config)).eval(), target)
    prompt = torch.tensor([5, 17, 99, 3, 42, 64, 8])
    target.allocate(64)
    feats = target.prefill(prompt[None])
    drafter.allocate(64, TreeConfig(8, 3, 12))
    root = drafter.prefill(torch.cat([prompt, prompt[:1]])[None], feats)
    for n, depth in ((8, 3), (5, 2), (4, 1)):
        trees = [draft_tree(drafter, prompt[:1], root.logits, root.state, TreeConfig(n, depth, k))
                 for k in (n - 1, n + 1, 12)]
        for t in trees[1:]:
            assert torch.equal(t.tokens, trees[0].tokens) and torch.equal(t.parents, trees[0].parents)


def test_accepted_drafts_and_walk():
    # root 0 -> 1 (a), 2 (b); 1 -> 3 (c), 4 (d); 3 -> 5 (e)
    tokens, parents = [9, 10, 11, 12, 13, 14], [0, 0, 0, 1, 1, 3]
    assert tune.accepted_drafts(tokens, parents, [10, 12, 14, 99]) == 3
    assert tune.accepted_drafts(tokens, parents, [10, 13, 14]) == 2
    assert tune.accepted_drafts(tokens, parents, [11, 12]) == 1  # 12 is not a child of 11's node
    assert tune.accepted_drafts(tokens, parents, [99]) == 0
    assert tune.accepted_drafts(tokens, parents, []) == 0
    assert tune.walk([0] * 9, 10) == (10, 10)  # autoregressive: one token a forward
    # prefill makes token 0; round at 0 accepts 2 (+ bonus) -> 3 tokens; at 3: 0 -> 1; at 4: 5, capped at 10
    assert tune.walk([2, 0, 0, 0, 5, 0, 0, 0, 0], 10) == (10, 4)
    assert tune.walk([], 1) == (1, 1)


def test_cost_model_prediction_prune_and_pick():
    costs = tune.Costs(target_s={1: 0.10, 8: 0.12, 64: 0.40}, step_s={1: 0.02, 4: 0.03}, commit_s={2: 0.02, 8: 0.03},
                       rest_s=0.01, build_s={TreeConfig(8, 3, 4): 0.005})
    assert costs.round_s(tune.AR) == pytest.approx(0.11)
    chain = 0.10 + 0.02 * 3 / 7 + 2 * 0.02 + (0.02 + 0.01 * 2 / 6) + 0.01  # t(4) interpolated, commit of 4 rows
    assert costs.round_s(TreeConfig(4, 3, 1)) == pytest.approx(chain)
    assert costs.round_s(TreeConfig(8, 3, 4)) == pytest.approx(0.12 + 2 * 0.03 + 0.005 + 0.02 + 0.01 / 3 + 0.01)
    assert tune._interp(costs.target_s, 120) == pytest.approx(0.40 + (0.40 - 0.12) * 56 / 56)  # extended linearly
    runs = [tune.Replayed(new_tokens=30, forwards=10, prefill_s=0.5), tune.Replayed(20, 10, 0.5)]
    tau, rate = tune.predict(costs, TreeConfig(8, 3, 4), runs)
    assert tau == pytest.approx(2.5) and rate == pytest.approx(50 / (1.0 + 18 * costs.round_s(TreeConfig(8, 3, 4))))
    a, b, c, d = TreeConfig(2, 1, 1), TreeConfig(3, 2, 1), TreeConfig(4, 3, 1), TreeConfig(5, 4, 1)
    assert tune.prune({a: 10.0, b: 8.0, c: 7.0, d: 1.0}, keep_frac=0.75, min_keep=1) == {a, b}
    assert tune.prune({a: 10.0, b: 8.0, c: 7.0, d: 1.0}, keep_frac=0.75, min_keep=3) == {a, b, c}
    rows = [{"tree": tune.AR, "steady_tokens_per_s": 9.0, "tokens_per_s": 9.0},
            {"tree": a, "steady_tokens_per_s": 8.0, "tokens_per_s": 8.5},
            {"tree": b, "steady_tokens_per_s": 8.5, "tokens_per_s": 7.5},
            {"tree": c, "steady_tokens_per_s": 8.5, "tokens_per_s": 7.9}]
    assert tune.pick(rows)["tree"] == c  # never AR; best steady tokens/s, then plain tokens/s
    with pytest.raises(ValueError):
        tune.pick(rows[:1])


def test_write_preset_keeps_other_entries(tmp_path):
    path = write(tmp_path, TABLE)
    entry = {"tree": {"total_tokens": 5, "depth": 4, "top_k": 1}, "measured": {"tuned": True}}
    tune.write_preset(path, "tiny-x", "cpu", entry)
    tune.write_preset(path, "new-model", "cuda", entry)
    table = json.loads(path.read_text())
    assert table["tiny-x"]["cpu"] == entry and table["tiny-x"]["cuda"] == TABLE["tiny-x"]["cuda"]
    assert table["new-model"] == {"cuda": entry} and table["_shapes"] == TABLE["_shapes"]


def noisy_draft(model, scale: float):
    """A draft model: a copy of ``model`` with Gaussian noise of ``scale`` on every weight (seeded), so that
    it proposes what the target accepts often, not always."""
    draft = copy.deepcopy(model)
    with torch.no_grad():
        g = torch.Generator().manual_seed(3)
        for p in draft.parameters():
            p.add_(scale * torch.randn(p.shape, generator=g))
    return draft


def test_tune_end_to_end_replay_equals_real_decoding(tiny_llama):
    """A draft model that is a noisy copy of the target accepts some drafts: every finalist's tau from the
    replay must be the tau of really decoding it, and the chosen tree must be one of the grid's."""
    gen = SpeculativeGenerator(tiny_llama, WordTokenizer(), draft_model=noisy_draft(tiny_llama, 0.02))
    prompts = [[5, 17, 99, 3, 42, 64, 8], [7, 7, 30, 101, 12], [90, 4, 56, 23, 11, 70]]
    grid = tune.candidate_grid((4, 8), (1, 2, 3), (1, 2))
    entry = tune.tune(gen, prompts, grid, max_new_tokens=14, validate=3, finalists=2, prune_after=1,
                      keep_frac=0.5, repeats=1, warmup=0, log=lambda msg: None, replay_table=True)
    chosen = TreeConfig(**entry["tree"])
    assert chosen in grid
    m = entry["measured"]
    rows = {r["tree"]: r for r in m["finalists"]}
    assert set(rows) >= {"ar", "60/6/10", chosen.label} and len(rows) >= 4
    for name, row in rows.items():
        if "replay_tau" in row:
            assert row["replay_tau"] == pytest.approx(row["tau"]), name
    assert rows["ar"]["tau"] == 1.0 and m["tau"] == rows[chosen.label]["tau"]
    assert m["replay"]["trees"] == len(grid) and m["replay"]["kept_to_the_end"] >= 2
    assert set(m["costs_ms"]["draft_step_by_top_k"]) == {"1", "2"}
    table = m["replay"]["tau_by_tree"]  # every tree replayed to the end, highest tau first
    assert len(table) == m["replay"]["kept_to_the_end"] and list(table.values()) == sorted(table.values(), reverse=True)
    for name, row in rows.items():
        if "replay_tau" in row:
            assert table[name] == pytest.approx(row["replay_tau"], abs=1e-3), name


def test_tune_shortlist_measures_every_tree_and_picks_the_fastest(tiny_llama):
    """The GPU mode (--trees): every listed tree, AR and the EAGLE-2 default are really decoded on every
    prompt; the pick is the drafting tree with the best steady tokens/s; tau is what decoding gives."""
    gen = SpeculativeGenerator(tiny_llama, WordTokenizer(), draft_model=tiny_llama)  # self-draft: all accepted
    prompts = [[5, 17, 99, 3, 42, 64, 8], [7, 7, 30, 101, 12]]
    trees = [TreeConfig(3, 2, 1), TreeConfig(5, 4, 1)]
    logged = []
    entry = tune.tune_shortlist(gen, prompts, trees, max_new_tokens=12, log=logged.append)
    m = entry["measured"]
    rows = {r["tree"]: r for r in m["finalists"]}
    assert set(rows) == {"ar", "3/2/1", "5/4/1", "60/6/10"}
    assert rows["ar"]["tau"] == 1.0 and rows["5/4/1"]["tau"] > rows["3/2/1"]["tau"] > 1.5
    drafting = {k: v for k, v in rows.items() if k != "ar"}
    best = max(drafting, key=lambda k: drafting[k]["steady_tokens_per_s"])
    assert TreeConfig(**entry["tree"]).label == best and m["tau"] == rows[best]["tau"]
    # after each prompt, every tree's figures so far (the last line: all prompts, as in the entry)
    progress = [line for line in logged if line.startswith("measured prompt")]
    assert [line.split(":")[0] for line in progress] == ["measured prompt 1/2", "measured prompt 2/2"]
    tau, speedup = re.search(r"5/4/1 tau ([\d.]+) x([\d.]+)", progress[-1]).groups()
    assert abs(float(tau) - rows["5/4/1"]["tau"]) <= 0.006  # the entry keeps 3 decimals, the log 2
    assert abs(float(speedup) - rows["5/4/1"]["speedup_vs_ar"]) <= 0.006


def test_trees_argument():
    trees = tune._trees("60/6/10, 8/3/4, 48/5/8/v16384, 48/5/8/4096")
    assert trees == [TreeConfig(60, 6, 10), TreeConfig(8, 3, 4), TreeConfig(48, 5, 8, 16384), TreeConfig(48, 5, 8, 4096)]
    assert [t.label for t in trees] == ["60/6/10", "8/3/4", "48/5/8/v16384", "48/5/8/v4096"]
    assert [TreeConfig.parse(t.label) for t in trees] == trees
    for bad, why in (("60/6", "total/depth/top_k"), ("60/x/10", "total/depth/top_k"), ("48/5/8/w9", "total/depth"),
                     ("0/1/1", "total_tokens must be"), ("48/5/8/v4", "draft_vocab")):
        with pytest.raises(argparse.ArgumentTypeError, match=why):
            tune._trees(bad)


def test_a_tree_with_a_pool_of_sampled_children():
    """TreeConfig.pool: where sampled children come from; in labels, presets and results only when set, and
    refused (one line) below top_k, above the draft vocabulary, or written twice."""
    from fsd_eagle.trees_presets import tree_from_spec

    tree = TreeConfig.parse("64/6/8/v16384/p16")
    assert tree == TreeConfig(64, 6, 8, 16384, pool=16) and tree.label == "64/6/8/v16384/p16"
    assert TreeConfig.parse("64/6/8/p32") == TreeConfig(64, 6, 8, pool=32)
    assert tree.to_dict() == {"total_tokens": 64, "depth": 6, "top_k": 8, "draft_vocab": 16384, "pool": 16}
    assert tree_from_spec(tree.to_dict(), {}) == tree and "pool" not in TreeConfig(64, 6, 8).to_dict()
    for bad, why in (("64/6/8/p4", "pool \\(4\\) must be 0 or at least top_k"),
                     ("64/6/8/v16/p32", "at most draft_vocab"), ("64/6/8/p16/p16", "total/depth/top_k"),
                     ("64/6/8/p16/v100", "total/depth/top_k"), ("64/6/8/p", "total/depth/top_k")):
        with pytest.raises(ConfigError, match=why):
            TreeConfig.parse(bad)
    with pytest.raises(ConfigError, match="optionally draft_vocab and pool"):
        tree_from_spec({"total_tokens": 4, "depth": 2, "top_k": 2, "pools": 3}, {})


def test_a_preset_records_the_heads_weights(tmp_path):
    """A preset names the head it was tuned with by its weights' sha256 (the shipped head changes)."""
    import hashlib

    from fsd_eagle.head import EagleHead, HeadConfig
    from fsd_eagle.models import head_weights_sha256, save_head

    head = tmp_path / "head"
    save_head(EagleHead(HeadConfig(hidden_size=16, intermediate_size=32, num_attention_heads=2,
                                   num_key_value_heads=1, vocab_size=8)), head)
    weights = next(head.glob("*.safetensors"))
    assert head_weights_sha256(head) == hashlib.sha256(weights.read_bytes()).hexdigest()
    assert head_weights_sha256(None) is None and head_weights_sha256(tmp_path / "none") is None


def test_tuner_writes_each_bucket_at_once_and_resume_keeps_them(tmp_path, monkeypatch):
    """``python -m trees.tune --batch-sizes 2,4``: bucket 2 is in the presets file before bucket 4 is
    measured, so a run that dies in bucket 4 keeps it; ``--resume`` with the same command then measures only
    bucket 4 and leaves bucket 2 as it was; another command measures both again."""
    from test_api import save_target_and_head

    from eval.runinfo import git_commit

    folders = save_target_and_head(tmp_path / "models", head_seed=3)
    out = tmp_path / "presets.json"
    argv = ["--device", "cpu", "--threads", "1", "--target", str(folders / "target"), "--head", str(folders / "head"),
            "--out", str(out), "--batch-sizes", "2,4", "--max-new-tokens", "3", "--validate", "1",
            "--batch-new-tokens", "3", "--attention", "flex", "--batch-fill", "1"]
    measured, real = [], tune.tune_batch

    def failing_at_4(gen, prompts, candidates, b, **kw):
        measured.append((b, len(prompts)))
        if b == 4:
            raise RuntimeError("died in bucket 4")
        return real(gen, prompts, candidates, b, **kw)

    monkeypatch.setattr(tune, "tune_batch", failing_at_4)
    with pytest.raises(RuntimeError, match="bucket 4"):
        tune.main(argv)
    table = json.loads(out.read_text())
    (model,) = table
    assert set(table[model]["cpu"]["batch"]) == {"2"}
    first = table[model]["cpu"]["batch"]["2"]
    assert "--resume" not in first["measured"]["command"] and "--batch-fill 1" in first["measured"]["command"]
    assert first["measured"]["code"] == git_commit(short=True)  # the checkout's commit (None outside git)
    # what ran: rounds that are not compiled use SDPA, whatever attention was preferred
    assert [c["attention"] for c in first["measured"]["candidates"]] == ["sdpa"] * len(first["measured"]["candidates"])

    monkeypatch.setattr(tune, "tune_batch", lambda *a, **kw: (measured.append((a[3], len(a[1]))), real(*a, **kw))[1])
    measured.clear()
    assert tune.main(argv + ["--resume"]) == 0
    assert measured == [(4, 4)]
    table = json.loads(out.read_text())
    assert set(table[model]["cpu"]["batch"]) == {"2", "4"} and table[model]["cpu"]["batch"]["2"] == first
    measured.clear()
    assert tune.main(argv[:-1] + ["2", "--resume"]) == 0  # --batch-fill 2: another command, both again
    assert measured == [(2, 4), (4, 8)]


def test_tuner_writes_a_sampling_preset_beside_the_greedy_one(tmp_path, capsys):
    """``--trees ... --temperature 0.7``: every tree is decoded sampling, and the winner becomes the device
    entry's "sampling" tree; the greedy tree and the batch buckets stay. A greedy run afterwards keeps the
    sampling preset. --temperature without --trees, with batch sizes or --resume is refused."""
    from test_api import save_target_and_head

    folders = save_target_and_head(tmp_path / "models", head_seed=3)
    out = tmp_path / "presets.json"
    base = ["--device", "cpu", "--threads", "1", "--target", str(folders / "target"), "--head", str(folders / "head"),
            "--out", str(out), "--max-new-tokens", "4", "--validate", "2"]
    assert tune.main(base + ["--trees", "4/2/2"]) == 0
    model = next(iter(json.loads(out.read_text())))
    tune.write_preset(out, model, "cpu", {"tree": "chain-3"}, bucket=8)
    greedy = json.loads(out.read_text())[model]["cpu"]
    assert tune.main(base + ["--trees", "3/2/1,5/2/2", "--temperature", "0.7"]) == 0
    entry = json.loads(out.read_text())[model]["cpu"]
    assert {k: entry[k] for k in greedy} == greedy  # tree, measured and batch as they were
    sampling = entry["sampling"]
    assert sampling["measured"]["temperature"] == 0.7 and "sampled at temperature 0.7" in sampling["measured"]["validation"]
    assert {r["tree"] for r in sampling["measured"]["finalists"]} == {"ar", "3/2/1", "5/2/2", "60/6/10"}
    chosen = TreeConfig(**sampling["tree"])
    assert chosen.label in {"3/2/1", "5/2/2", "60/6/10"}
    assert trees_presets.preset_for(model, "cpu", out) == TreeConfig(**greedy["tree"])
    assert trees_presets.preset_entry(model, "cpu", out, sampling=True).tree == chosen
    assert tune.main(base + ["--trees", "4/2/2"]) == 0  # greedy again: the sampling preset is kept
    assert json.loads(out.read_text())[model]["cpu"]["sampling"] == sampling
    capsys.readouterr()
    for extra in (["--temperature", "0.7"], ["--trees", "4/2/2", "--temperature", "0.7", "--batch-sizes", "1,2"],
                  ["--trees", "4/2/2", "--temperature", "0.7", "--resume"], ["--trees", "4/2/2", "--temperature", "-1"]):
        with pytest.raises(SystemExit) as e:
            tune.main(base + extra)
        assert e.value.code == 2
        assert "--temperature" in capsys.readouterr().err


def test_held_out_prompts_go_on_with_gsm8k_past_mt_bench():
    """A batch bucket of 64 decodes 256 prompts: MT-bench's 80 first turns alternate with GSM8K test
    questions, then GSM8K goes on alone; no prompt repeats."""
    from trees.tune import held_out_prompts

    prompts = held_out_prompts(256)
    sources = [source for source, _ in prompts]
    assert len(prompts) == 256 and len(set(sources)) == 256
    assert sum(s.startswith("mt_bench/") for s in sources) == 80
    assert all(s.startswith("mt_bench/") == (i % 2 == 0) for i, s in enumerate(sources[:160]))


def test_tuner_decodes_a_pool_tree_with_its_sampled_children(tiny_llama):
    """Sampling tuner runs (--temperature) decode each listed tree as generate() would: a tree with a pool
    samples its children from the pool (the default children follow the tree), so its tokens for a seed
    are those of generate(children="sampled"), not those of top children."""
    gen = SpeculativeGenerator(tiny_llama, WordTokenizer(), draft_model=noisy_draft(tiny_llama, 0.05))
    gen.configure(cuda_graphs=False, compile=False)
    tuner = tune.Tuner(gen, log=lambda msg: None)
    prompt = [5, 17, 99, 3, 42, 64, 8]
    run = tuner.decode(prompt, TreeConfig(8, 3, 2, pool=4), 24, temperature=0.9, seed=3)
    assert gen.tree == TreeConfig(8, 3, 2, pool=4)
    by_children = {c: gen.generate(prompt, 24, temperature=0.9, seed=3, chat=False, children=c).token_ids
                   for c in ("sampled", "top")}
    assert run.tokens[:24] == by_children["sampled"][:len(run.tokens[:24])]
    assert by_children["sampled"] != by_children["top"]

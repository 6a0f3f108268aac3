"""eval/warm.py: `eval speed --warm N` compiles each compiled row's configuration in a process of its own first."""

from __future__ import annotations

import subprocess
import sys
from argparse import Namespace
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))  # eval/ is not installed: import it from the checkout

from eval.warm import run_side_by_side, warmups  # noqa: E402


def _options(**kw) -> Namespace:
    base = dict(target=None, head="heads/h", draft_model=None, device="cuda", dtype="bfloat16", threads=None,
                prompts="mt_bench", top_p=1.0, seed=0, total_tokens=None, depth=None, tree_top_k=None,
                draft_vocab=None, pool=None, trees=None, inductor_freezing=False, rows="")
    return Namespace(**{**base, **kw})


def test_one_warmup_per_row_configuration():
    """The sampling benchmark's 11 compiled rows: AR at each temperature, EAGLE-2 and each FSD rule greedy and
    at T = 0.7 with top and sampled children; hf is not compiled. Each run is short, compiled, writes nowhere
    of the full run's, and keeps what decides its shapes (head, tree, dtype)."""
    jobs = warmups(_options(total_tokens=64), ["hf", "ar", "eagle2", "fsd"], [("kl", 1.0), ("reverse_kl", 1.0)],
                   [0.0, 0.7], ["top", "sampled"])
    assert [j.name for j in jobs] == [
        "ar_t0", "ar_t0.7", "eagle2_t0", "eagle2_t0.7", "eagle2_t0.7_sampled",
        "fsdkl1_t0", "fsdkl1_t0.7", "fsdkl1_t0.7_sampled",
        "fsdreverse_kl1_t0", "fsdreverse_kl1_t0.7", "fsdreverse_kl1_t0.7_sampled"]
    sampled = dict(zip([j.name for j in jobs], jobs))["fsdreverse_kl1_t0.7_sampled"].options
    text = " ".join(sampled)
    for part in ("--backends compiled", "--limit 2", "--head heads/h", "--total-tokens 64", "--dtype bfloat16",
                 "--methods fsd", "--fsd reverse_kl:1", "--temperatures 0.7", "--children sampled"):
        assert part in text, part
    assert "--out" not in sampled and "--depth" not in sampled  # unset options keep the preset
    assert len({j.name for j in jobs}) == len(jobs)
    several = warmups(_options(), ["fsd"], [("kl", 1.0), ("reverse_kl", 1.0), ("kl", 2.0)], [0.0], ["top"])
    assert [j.name for j in several] == ["fsdkl1_t0", "fsdreverse_kl1_t0"]  # kl:2 compiles what kl:1 does


def test_rows_choose_what_is_measured_and_warmed():
    """--rows: glob patterns of row names; warm-ups only for the configurations of rows it keeps (with --trees,
    names carry the tree), and each warm-up measures only those rows. With several trees each drafting
    configuration warms once per tree, in a run of its own (side by side), plain decoding once."""
    from eval.speed import row_patterns, row_wanted

    patterns = row_patterns("ar_*, eagle2_64-6-8-p16_*,eagle2_64-6-8-p32_compiled_t0.7_sampled,fsd_*p16*sampled")
    sampled = {"method": "fsd", "divergence": "kl", "threshold": 1.0, "backend": "compiled", "temperature": 0.7,
               "top_p": 1.0, "children": "sampled", "tree": "64/6/8/p16"}
    assert row_wanted(patterns, sampled, with_tree=True)
    assert not row_wanted(patterns, {**sampled, "children": "top"}, with_tree=True)
    assert not row_wanted(patterns, {**sampled, "tree": "64/6/8/p32"}, with_tree=True)
    assert row_wanted([], {**sampled, "children": "top"})
    a = _options(trees="64/6/8/p16,64/6/8/p32", rows=",".join(patterns))
    jobs = warmups(a, ["ar", "eagle2", "fsd"], [("kl", 1.0), ("reverse_kl", 1.0)], [0.0, 0.7], ["top", "sampled"])
    assert [j.name for j in jobs] == [
        "ar_t0", "ar_t0.7", "eagle2_64-6-8-p16_t0", "eagle2_64-6-8-p16_t0.7", "eagle2_64-6-8-p16_t0.7_sampled",
        "eagle2_64-6-8-p32_t0.7_sampled", "fsdkl1_64-6-8-p16_t0.7_sampled", "fsdreverse_kl1_64-6-8-p16_t0.7_sampled"]
    assert all(j.options[j.options.index("--rows") + 1] == a.rows for j in jobs)
    trees = {j.name: j.options[j.options.index("--trees") + 1] for j in jobs}
    assert trees["ar_t0"] == "64/6/8/p16,64/6/8/p32" and trees["eagle2_64-6-8-p32_t0.7_sampled"] == "64/6/8/p32"
    assert all(trees[n] == "64/6/8/p16" for n in trees if "p16" in n) and all(j.options.count("--trees") == 1 for j in jobs)
    assert len(warmups(_options(rows="hf_*"), ["ar", "eagle2"], [], [0.0], ["top"])) == 0


def test_side_by_side_reports_each_status(tmp_path):
    ok = [sys.executable, "-c", "print('fine')"]
    bad = [sys.executable, "-c", "raise SystemExit(3)"]
    status = run_side_by_side([("a", ok), ("b", bad), ("c", ok)], 2, tmp_path / "logs")
    assert status == {"a": 0, "b": 3, "c": 0}
    assert (tmp_path / "logs" / "a.log").read_text().strip() == "fine"


def test_warm_only_without_a_compiled_backend_loads_nothing(tmp_path):
    out = subprocess.run([sys.executable, "-m", "eval", "speed", "--device", "cpu", "--backends", "graph",
                          "--warm-only", "--out", str(tmp_path / "speed.json")], cwd=ROOT, capture_output=True,
                         text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert "nothing to compile" in out.stdout and not (tmp_path / "speed.json").exists()

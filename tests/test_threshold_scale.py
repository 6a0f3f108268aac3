"""eval/threshold_scale.py: divergences where a draft LM's top token differs from the target's, teacher-forced
along recorded answers; what share of those positions each FSD threshold accepts."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from test_api import make_llama, make_tokenizer

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from eval.threshold_scale import main, parse_pairs, scale  # noqa: E402
from fsd_eagle.errors import InputError  # noqa: E402


def test_scale_counts_differing_tops_and_accepted_shares_by_hand():
    """Three positions: tops agree at the first, differ at the other two; reverse_kl there is computed
    independently, and a threshold between the two values accepts exactly one of them."""
    p = torch.tensor([[3.0, 0.0, 0.0], [2.0, 1.0, 0.0], [0.0, 0.0, 4.0]]).log_softmax(-1)
    q = torch.tensor([[2.0, 0.0, 0.0], [1.0, 2.0, 0.0], [4.0, 0.0, 0.0]]).log_softmax(-1)
    rkl = [float((p[i].exp() * (p[i] - q[i])).sum()) for i in (1, 2)]  # KL(p || q)
    mid = (rkl[0] + rkl[1]) / 2
    out = scale(p, q, {"reverse_kl": [0.0, mid, 100.0]})
    assert (out["positions"], out["tops_differ"], out["share_differ"]) == (3, 2, round(2 / 3, 4))
    assert out["accepted_share"]["reverse_kl"] == {"0": 0.0, f"{mid:g}": 0.5, "100": 1.0}
    qs = out["quantiles_where_tops_differ"]["reverse_kl"]
    assert qs["q50"] == pytest.approx(sum(rkl) / 2, abs=1e-4) and qs["q10"] <= qs["q50"] <= qs["q90"]


def test_bad_thresholds_are_refused_with_one_line():
    with pytest.raises(InputError, match="DIVERGENCE:T1"):
        parse_pairs(["kl"])
    with pytest.raises(InputError, match="got 'nope:1'"):
        parse_pairs(["nope:1"])
    assert parse_pairs(["kl:1,2", "js:0.2"]) == {"kl": [1.0, 2.0], "js": [0.2]}


def test_command_on_tiny_models_matches_an_independent_count(tmp_path):
    """The tool on a tiny target and a perturbed copy as draft LM, over recorded answers of the arithmetic
    task: positions and differing tops equal a count made here with the same forwards; accepted shares grow
    with the threshold and reach 1 at inf; a missing records file is one line on stderr and exit code 2."""
    target, draft = make_llama(seed=0), make_llama(seed=0)
    with torch.no_grad():
        for w in draft.parameters():
            w.add_(0.05 * torch.randn(w.shape, generator=torch.Generator().manual_seed(w.numel())))
    for model, name in ((target, "target"), (draft, "draft")):
        model.save_pretrained(tmp_path / name)
        make_tokenizer().save_pretrained(tmp_path / name)
    records = tmp_path / "raw" / "ar"
    records.mkdir(parents=True)
    answers = {"0": [5, 9, 11, 4, 7, 8], "1": [12, 3, 3, 6]}
    (records / "arith.jsonl").write_text("".join(json.dumps({"qid": q, "token_ids": ids}) + "\n"
                                                 for q, ids in answers.items()))
    out = tmp_path / "scale.json"
    result = main(["--target", str(tmp_path / "target"), "--draft-model", str(tmp_path / "draft"),
                   "--records", str(tmp_path / "raw" / "ar"), "--tasks", "arith", "--thresholds",
                   "reverse_kl:0.001,0.1,inf", "--out", str(out)])
    got = result["tasks"]["arith"]
    assert json.loads(out.read_text())["tasks"]["arith"] == got

    from eval.sweep import load_questions
    from fsd_eagle.api import SpeculativeGenerator
    gen = SpeculativeGenerator.load(str(tmp_path / "target"), device="cpu", dtype="float32")
    prompts = {q.qid: q.prompt for q in load_questions("arith")}
    differ = 0
    for qid, ids in answers.items():
        prompt = list(gen.encode(prompts[qid]))
        x = torch.tensor([prompt + ids])
        with torch.no_grad():
            a = target(x).logits[0, len(prompt) - 1:-1].argmax(-1)
            b = draft(x).logits[0, len(prompt) - 1:-1].argmax(-1)
        differ += int((a != b).sum())
    assert got["positions"] == 10 and got["tops_differ"] == differ > 0
    shares = list(got["accepted_share"]["reverse_kl"].values())
    assert shares == sorted(shares) and shares[-1] == 1.0

    bad = subprocess.run([sys.executable, "-m", "eval.threshold_scale", "--target", str(tmp_path / "target"),
                          "--draft-model", str(tmp_path / "draft"), "--records", str(tmp_path), "--tasks", "arith"],
                         cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert bad.returncode == 2 and bad.stderr.strip().startswith("error: no records of arith")
    assert "Traceback" not in bad.stderr

"""The generated arithmetic task (eval/arith.py) and what the sweep and reports need for the reproduction of
the FSD trade-off: the task in the sweep, sampling sweeps (--temperature), speed rows of the sweep's
temperature merged, and the speed benchmark's GSM8K / arithmetic prompts."""

from __future__ import annotations

import hashlib
import json
import sys
from pathlib import Path

import pytest
import torch
from test_api import save_target_and_head

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from eval.__main__ import main as eval_main  # noqa: E402
from eval.arith import TEST_SIZE, arith_problems, make_problem  # noqa: E402
from eval.metrics import extract_gsm8k_answer  # noqa: E402
from eval.report import aggregate, merge_speed  # noqa: E402
from eval.speed import load_prompts  # noqa: E402
from eval.sweep import load_questions, score  # noqa: E402
from eval.tasks import GSM8K_INSTRUCTION, load_arith  # noqa: E402
from fsd_eagle.errors import InputError  # noqa: E402
from training.data import iter_arith_train, iter_gsm8k_train  # noqa: E402

torch.set_num_threads(1)
TREE = ["--total-tokens", "6", "--depth", "3", "--tree-top-k", "2", "--threads", "1"]


def test_problems_are_fixed_checkable_and_the_splits_disjoint():
    """The same problems on every machine (a digest of the first ones), each solution ends with its answer,
    and no train question is a test question."""
    test = arith_problems("test")
    assert len(test) == TEST_SIZE and len({p.question for p in test}) == TEST_SIZE
    digest = hashlib.sha256("\n".join(p.question + p.solution for p in test[:5]).encode()).hexdigest()
    assert digest == hashlib.sha256("\n".join(make_problem("test", i).question + make_problem("test", i).solution
                                              for i in range(5)).encode()).hexdigest()
    assert test[0].question.startswith("Farid has 44 cards.") and test[0].reference == "514"
    train = arith_problems("train", 3000)
    assert not {p.question for p in train} & {p.question for p in test}
    for p in test + train:
        assert extract_gsm8k_answer(p.solution) == p.reference and int(p.reference) >= 0
    assert arith_problems("train", 10) == train[:10]


def test_loader_and_training_data_ask_as_the_evaluation_asks():
    assert len(load_arith(limit=7)) == 7
    with pytest.raises(InputError):
        load_arith("dev")
    q = load_questions("arith", 3)[1]
    p = arith_problems("test", 2)[1]
    assert q.prompt == f"{p.question}\n\n{GSM8K_INSTRUCTION}" and q.payload["reference"] == p.reference
    conv = next(iter(iter_arith_train(1, eval_prompts=True)))
    assert conv.messages[0]["content"].endswith(GSM8K_INSTRUCTION) and conv.messages[1]["content"].endswith(".")
    assert score("arith", {"reference": "12"}, "so 3 * 4 = 12.\nThe answer is 12.")["correct"]


def test_gsm8k_train_prompts_equal_the_sweeps_prompt_format():
    from eval.tasks import gsm8k_prompt, load_gsm8k

    train = load_gsm8k("train", limit=2)
    convs = list(iter_gsm8k_train(eval_prompts=True))[:2]
    assert [c.messages[0]["content"] for c in convs] == [gsm8k_prompt(p) for p in train]


@pytest.fixture(scope="module")
def folders(tmp_path_factory):
    return save_target_and_head(tmp_path_factory.mktemp("arith_models"), head_seed=5)


def test_sweep_runs_the_arith_task_sampling_and_keeps_the_temperature(folders, tmp_path, capsys):
    out = tmp_path / "sweep"
    argv = ["sweep", "--target", str(folders / "target"), "--head", str(folders / "head"), "--device", "cpu",
            "--dtype", "float32", "--out", str(out), "--no-progress", *TREE, "--tasks", "arith", "--limit", "2",
            "--methods", "ar", "eagle2", "--max-new-tokens", "6", "--temperature", "0.7"]
    assert eval_main(argv) == 0
    settings = json.loads((out / "settings.json").read_text())
    assert settings["temperature"] == 0.7 and set(settings["max_new_tokens"]) == {"gsm8k", "mmlu", "humaneval",
                                                                                 "arith"}
    results = json.loads((out / "results.json").read_text())
    assert {r["config"]: r["n"] for r in results["rows"]} == {"ar": {"arith": 2}, "eagle2": {"arith": 2}}
    assert "arith_acc" in results["rows"][0]
    assert "sampling at temperature 0.7" in (out / "results.md").read_text()
    assert eval_main(argv[:-1] + ["0"]) == 2  # a greedy run does not mix into a sampling folder
    assert "temperature" in capsys.readouterr().err


def test_greedy_settings_keep_their_old_form(folders, tmp_path):
    """A greedy sweep without the new task writes settings.json as before (older folders still resume)."""
    out = tmp_path / "g"
    assert eval_main(["sweep", "--target", str(folders / "target"), "--head", str(folders / "head"), "--device",
                      "cpu", "--dtype", "float32", "--out", str(out), "--no-progress", *TREE, "--tasks", "gsm8k",
                      "--limit", "1", "--methods", "ar", "--max-new-tokens", "4"]) == 0
    settings = json.loads((out / "settings.json").read_text())
    assert "temperature" not in settings and set(settings["max_new_tokens"]) == {"gsm8k", "mmlu", "humaneval"}


def test_speed_rows_of_the_sweeps_temperature_are_merged():
    records = [{"task": "arith", "qid": str(i), "config": c, "method": c, "divergence": None,
                "threshold": 0.0 if c == "eagle2" else None, "correct": True, "token_ids": [1, 2], "new_tokens": 2,
                "target_forwards": 1, "elapsed_s": 0.1} for i in range(3) for c in ("ar", "eagle2")]
    speed = {"rows": [{"method": "ar", "backend": "graph", "temperature": 0.0, "tokens_per_s": 100.0},
                      {"method": "ar", "backend": "graph", "temperature": 0.7, "tokens_per_s": 90.0},
                      {"method": "eagle2", "backend": "graph", "temperature": 0.7, "tokens_per_s": 180.0}]}
    greedy, sampled = aggregate(records), aggregate(records)
    assert merge_speed(greedy, speed, "s") == 1
    assert merge_speed(sampled, speed, "s", temperature=0.7) == 2
    assert [r["tokens_per_s"] for r in sampled] == [90.0, 180.0] and sampled[1]["speedup_vs_ar"] == 2.0


def test_speed_benchmark_prompts():
    assert load_prompts("gsm8k", 2)[0].endswith(GSM8K_INSTRUCTION)
    assert load_prompts("arith", 3) == [f"{p.question}\n\n{GSM8K_INSTRUCTION}" for p in arith_problems("test", 3)]
    assert len(load_prompts("mt_bench", 4)) == 4


def test_draft_model_sweep_batched_and_sampling(folders, tmp_path, capsys):
    """The classic-SD rows: a draft LM built from the target's first layer drafts a chain of 5 (batched,
    sampling), with FSD reverse KL beside exact SD, on the same questions."""
    from training.__main__ import main as training_main

    assert training_main(["draft-model", "--target", str(folders / "target"), "--layers", "1", "--out",
                          str(tmp_path / "draft"), "--device", "cpu"]) == 0
    out = tmp_path / "sd"
    assert eval_main(["sweep", "--target", str(folders / "target"), "--draft-model", str(tmp_path / "draft" / "model"),
                      "--device", "cpu", "--dtype", "float32", "--out", str(out), "--no-progress", "--threads", "1",
                      "--total-tokens", "6", "--depth", "5", "--tree-top-k", "1", "--tasks", "arith", "--limit", "3",
                      "--methods", "ar", "eagle2", "fsd", "--divergences", "reverse_kl", "--thresholds",
                      "reverse_kl:1", "--max-new-tokens", "8", "--batch-size", "2", "--temperature", "0.7"]) == 0
    capsys.readouterr()
    settings = json.loads((out / "settings.json").read_text())
    assert settings["draft_model"].endswith("model") and settings["tree"] == {"total_tokens": 6, "depth": 5,
                                                                              "top_k": 1}
    rows = {r["config"]: r for r in json.loads((out / "results.json").read_text())["rows"]}
    assert set(rows) == {"ar", "eagle2", "fsd-reverse_kl-1"} and all(r["n"] == {"arith": 3} for r in rows.values())
    assert rows["eagle2"]["tau"] >= 1.0

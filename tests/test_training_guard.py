"""The trainer refuses what would waste or spoil a run (docs/hardening.md, item 6): ``--resume`` of a run folder
made for another target, recipe or data (the run's fingerprint, run.json, names the difference, and nothing
in the folder changes), and recipe or option values it cannot use, refused before any data is read, the
target is loaded or anything is distilled."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

import training.cli as cli
import training.distill
from conftest import tiny_model
from test_training import RECIPE, Setup, _one_line_error, _write, word_tokenizer
from training.__main__ import main
from training.fingerprint import FINGERPRINT_FILE


@pytest.fixture(scope="module")
def setup(tmp_path_factory) -> Setup:
    return Setup(tmp_path_factory.mktemp("guard"), "llama")


@pytest.fixture(scope="module")
def started(setup, tmp_path_factory) -> Path:
    """A run stopped after its first step (a checkpoint, no head yet), to be resumed."""
    out = tmp_path_factory.mktemp("started") / "run"
    assert main(setup.argv(out, "--stop-after", 0)) == 0
    assert (out / FINGERPRINT_FILE).exists() and (out / "checkpoint").exists()
    return out


def snapshot(folder: Path) -> dict:
    return {p: p.read_bytes() for p in sorted(folder.rglob("*")) if p.is_file()}


def other_target(setup, root: Path, kind: str) -> Path:
    folder = root / f"target-{kind}"
    if kind == "vocabulary":
        model = tiny_model("llama", vocab_size=96, seed=1)
        model.save_pretrained(folder)
        word_tokenizer().save_pretrained(folder)
    else:  # the same config, other weights (e.g. a fine-tuned copy)
        shutil.copytree(setup.target, folder)
        tiny_model("llama", vocab_size=128, seed=7).save_pretrained(folder)
    return folder


@pytest.mark.parametrize("change, expected", [
    ("target: another vocabulary", "another target"),
    ("target: same config, other weights", "another target"),
    ("recipe: lr", "other recipe values (lr 0.005, not 0.001)"),
    ("recipe: unroll", "other recipe values (unroll 1, not 2)"),
    ("recipe: arch", "other recipe values (arch"),
    ("data: other content", "other data"),
])
def test_resume_refuses_another_run(setup, started, tmp_path, capsys, change, expected):
    run = tmp_path / "run"
    shutil.copytree(started, run)
    before = snapshot(run)
    kwargs, extra = {}, []
    if change.startswith("target"):
        kwargs["target"] = other_target(setup, tmp_path, "vocabulary" if "vocabulary" in change else "weights")
    elif change == "recipe: lr":
        kwargs["recipe"] = setup.write_recipe("recipe_lr.json", lr=1e-3)
    elif change == "recipe: unroll":
        extra = ["--unroll", 2]
    elif change == "recipe: arch":
        extra = ["--arch", "eagle3"]
    else:
        data = tmp_path / "data.jsonl"
        data.write_text("".join(line for line in setup.data.read_text().splitlines(keepends=True)[:-1]))
        kwargs["data"] = data
    capsys.readouterr()
    assert main(setup.argv(run, "--resume", *extra, **kwargs)) == 2
    err = _one_line_error(capsys)
    assert "--resume" in err and str(run) in err and expected in err, err
    assert snapshot(run) == before  # no head exported, no checkpoint touched


def test_resume_of_the_same_run_may_extend_it(setup, started, tmp_path):
    """The fingerprint leaves out what a resume may change: here the number of epochs, and a moved data file."""
    run = tmp_path / "run"
    shutil.copytree(started, run)
    moved = tmp_path / "moved.jsonl"
    shutil.copy(setup.data, moved)
    assert main(setup.argv(run, "--resume", "--epochs", 2, data=moved)) == 0
    assert (run / "head" / "model.safetensors").exists()


def test_resume_of_a_run_from_before_a_recipe_field_was_added(setup, started, tmp_path):
    """A run whose fingerprint predates a recipe field (its stored recipe lacks it) resumes when this call
    keeps that field's default, and is refused when it does not."""
    run = tmp_path / "run"
    shutil.copytree(started, run)
    stored = json.loads((run / FINGERPRINT_FILE).read_text())
    del stored["recipe"]["head_intermediate_size"]
    (run / FINGERPRINT_FILE).write_text(json.dumps(stored))
    refused = tmp_path / "refused"
    shutil.copytree(run, refused)
    assert main(setup.argv(refused, "--resume", "--head-intermediate-size", 96)) == 2
    assert main(setup.argv(run, "--resume")) == 0
    assert (run / "head" / "model.safetensors").exists()


def test_resume_of_a_run_without_fingerprint_is_taken_with_a_note(setup, started, tmp_path, capsys):
    run = tmp_path / "run"
    shutil.copytree(started, run)
    (run / FINGERPRINT_FILE).unlink()
    capsys.readouterr()
    assert main(setup.argv(run, "--resume")) == 0
    assert f"has no {FINGERPRINT_FILE}" in capsys.readouterr().err
    assert (run / FINGERPRINT_FILE).exists()


def test_a_new_run_seeded_with_distilled_answers_gets_no_note(setup, tmp_path, capsys):
    """A folder holding only distilled answers copied from another run (docs/gemma3.md) is a new run: no
    note about a missing fingerprint, which it then gets; anything else there still gets the note."""
    run = tmp_path / "run"
    run.mkdir()
    (run / "distilled.json").write_text("{}\n")
    capsys.readouterr()
    assert main(setup.argv(run, "--resume", "--stop-after", 0)) == 0
    assert "has no" not in capsys.readouterr().err and (run / FINGERPRINT_FILE).exists()
    other = tmp_path / "other"
    other.mkdir()
    (other / "notes.txt").write_text("x\n")
    assert main(setup.argv(other, "--resume", "--stop-after", 0)) == 0
    assert f"has no {FINGERPRINT_FILE}" in capsys.readouterr().err


BAD = {
    "epochs -1": ({"epochs": -1}, "epochs must be at least 1, got -1"),
    "epochs 0": ({"epochs": 0}, "epochs must be at least 1"),
    "epochs 2**40": ({"epochs": 2 ** 40}, "epochs must be at most"),
    "checkpoint_every 0": ({"checkpoint_every": 0}, "checkpoint_every must be at least 1"),
    "tokens_per_batch 0": ({"tokens_per_batch": 0}, "tokens_per_batch must be at least 1"),
    "max_len 1": ({"max_len": 1}, "max_len must be at least 2"),
    "warmup_steps -5": ({"warmup_steps": -5}, "warmup_steps must be at least 0"),
    "seed -1": ({"seed": -1}, "seed must be at least 0"),
    "lr NaN": ({"lr": float("nan")}, "lr must be a finite number, got nan"),
    "lr Infinity": ({"lr": float("inf")}, "lr must be a finite number, got inf"),
    "lr -0.1": ({"lr": -0.1}, "lr must be at least 0"),
    "grad_clip 0": ({"grad_clip": 0}, "grad_clip must be more than 0"),
    "noise -1": ({"noise": -1}, "noise must be at least 0"),
    "val_fraction 1.5": ({"val_fraction": 1.5}, "val_fraction must be less than 1"),
    "betas [1.5, 0.9]": ({"betas": [1.5, 0.9]}, "betas must be two numbers in [0, 1)"),
    "both loss weights 0": ({"feature_weight": 0, "ce_weight": 0}, "feature_weight and ce_weight are both 0"),
    "unroll 1000": ({"unroll": 1000}, "unroll must be at most 64"),
    "distill true as 1": ({"distill": 1}, "distill must be true or false"),
}
OPTIONS = {
    "--epochs -1": (["--epochs", -1], "--epochs must be at least 1, got -1"),
    "--distill-count -2": (["--distill-count", -2], "--distill-count must be at least 0"),
    "--unroll 0": (["--unroll", 0], "--unroll must be at least 1"),
    "--layers for eagle2": (["--layers", 0, 1], "layers and draft_vocab_size are eagle3 settings"),
    "--layers -1": (["--arch", "eagle3", "--layers", -1], "--layers must be a list of target layer ids >= 0"),
    "--draft-vocab-size -1": (["--arch", "eagle3", "--draft-vocab-size", -1], "--draft-vocab-size must be at least 0"),
    "--workers 0": (["--workers", 0], "--workers must be between 1 and 1024"),
    "--time-budget nan": (["--time-budget", "nan"], "--time-budget must be a finite number of seconds > 0"),
    "--stop-after -1": (["--stop-after", -1], "--stop-after must be a finite number of seconds >= 0"),
}


@pytest.fixture
def nothing_expensive(monkeypatch):
    """Fails the test if the run gets as far as loading the target or distilling."""
    def refuse(*args, **kwargs):
        raise AssertionError("a bad value was found only after an expensive step")

    monkeypatch.setattr(cli, "load_target", refuse)
    monkeypatch.setattr(training.distill, "distill", refuse)


@pytest.mark.parametrize("case", list(BAD) + list(OPTIONS))
def test_bad_values_are_refused_before_any_work(setup, tmp_path, capsys, nothing_expensive, case):
    if case in BAD:
        changes, expected = BAD[case]
        recipe = tmp_path / "recipe.json"
        _write(recipe, json.dumps({**RECIPE, **changes}))  # NaN / Infinity as json writes (and reads) them
        argv = setup.argv(tmp_path / "run", recipe=recipe)
    else:
        extra, expected = OPTIONS[case]
        argv = setup.argv(tmp_path / "run", *extra)
    assert main(argv) == 2
    err = _one_line_error(capsys)
    assert expected in err, err
    assert not (tmp_path / "run").exists()

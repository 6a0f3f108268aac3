"""The reproduction driver (eval/device/reproduce_steps.sh, reproduce.sh): shell syntax, and a real run of its
CPU-only first stage: the stage is marked done, then skipped when the script runs again."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
SCRIPTS = ("eval/device/reproduce.sh", "eval/device/reproduce_steps.sh", "eval/device/gemma3_head.sh",
           "eval/device/assemble.sh", "eval/device/batch.sh", "eval/device/job.sh", "eval/device/tp.sh")


def test_scripts_parse():
    for script in SCRIPTS:
        subprocess.run(["bash", "-n", str(ROOT / script)], check=True)


def _run(tmp_path: Path, stages: str) -> subprocess.CompletedProcess:
    env = {**os.environ, "RES": str(tmp_path), "STAGES": stages, "ARITH": "5", "PY": sys.executable,
           "PYTHONPATH": str(ROOT)}
    return subprocess.run(["bash", "eval/device/reproduce_steps.sh"], cwd=ROOT, env=env, capture_output=True,
                          text=True, timeout=120)


def test_data_stage_runs_once_and_unknown_stages_are_refused(tmp_path):
    first = _run(tmp_path, "data")
    assert first.returncode == 0, first.stderr
    data = tmp_path / "data" / "finetune.jsonl.gz"
    assert data.is_file() and (tmp_path / "done" / "data").is_file()
    assert "wrote 7478 conversations" in (tmp_path / "logs" / "data.log").read_text()
    again = _run(tmp_path, "data")
    assert again.returncode == 0 and "stage data: done before" in again.stdout
    bad = _run(tmp_path, "nonsense")
    assert bad.returncode == 2 and "unknown stage nonsense" in bad.stderr

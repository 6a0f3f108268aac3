"""Tests of the command line (``python -m fsd_eagle.cli generate ...``) on a tiny random model saved to disk.

Good runs go through ``fsd_eagle.cli.main`` in-process (fast). Bad input must exit non-zero with exactly one
``error: ...`` line on stderr and no traceback; those cases (and two good ones) run as separate processes: one
Python process imports torch and transformers once, then forks a child per case that runs the CLI module as
``__main__`` (as ``python -m fsd_eagle.cli`` does) with its own stdout, stderr and exit code.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys

import pytest
import torch

from fsd_eagle.cli import main
from test_api import save_target_and_head

torch.set_num_threads(1)  # tiny matmuls: threads only add contention

PROMPT = "w5 w17 w99 w3 w42 w64 w8"
KEYS = ("text", "new_tokens", "target_forwards", "tau", "tokens_per_s", "fuzzy_accepted")
ENV = dict(os.environ, OMP_NUM_THREADS="1", TOKENIZERS_PARALLELISM="false", HF_HUB_OFFLINE="1")


@pytest.fixture(scope="module")
def folders(tmp_path_factory):
    return save_target_and_head(tmp_path_factory.mktemp("cli_models"), head_seed=3)


def base_args(folders, *extra, head=True):
    args = ["generate", PROMPT, "--target", str(folders / "target"), "--device", "cpu", "--dtype", "float32",
            "--max-new-tokens", "16", "--total-tokens", "8", "--depth", "4", "--tree-top-k", "2"]
    if head:
        args += ["--head", str(folders / "head")]
    return args + list(extra)


def run_main(capfd, args):
    rc = main(args)
    out, err = capfd.readouterr()
    return rc, out, err


def run_json(capfd, args) -> dict:
    rc, out, err = run_main(capfd, args + ["--json"])
    assert rc == 0, err
    assert err == ""
    lines = out.splitlines()
    assert len(lines) == 1
    return json.loads(lines[0])


# ---------------------------------------------------------------------------------------- good runs


def test_json_keys_and_stats(folders, capfd):
    d = run_json(capfd, base_args(folders))
    for key in KEYS:
        assert key in d
    assert isinstance(d["text"], str) and d["text"]
    assert all(w.startswith("w") for w in d["text"].split())
    assert d["new_tokens"] == 16 or d["stop_reason"] == "eos"
    assert 1 <= d["target_forwards"] <= d["new_tokens"]
    assert d["tau"] == pytest.approx(d["new_tokens"] / d["target_forwards"], abs=1e-4)
    assert d["tokens_per_s"] > 0
    assert d["fuzzy_accepted"] == 0


def test_autoregressive_same_text_at_temperature_0(folders, capfd):
    spec = run_json(capfd, base_args(folders))
    ar = run_json(capfd, base_args(folders, "--autoregressive"))
    no_head = run_json(capfd, base_args(folders, head=False))
    assert spec["text"] == ar["text"] == no_head["text"]
    rc, out, err = run_main(capfd, base_args(folders, head=False))  # without --json: said on stderr, once
    assert rc == 0 and out.strip() == spec["text"].strip()
    assert err.count("note: no draft head is shipped for target: decoding autoregressively") == 1
    assert ar["target_forwards"] == ar["new_tokens"] and ar["tau"] == 1.0
    chain = run_json(capfd, base_args(folders, "--tree-top-k", "1", "--total-tokens", "5"))
    assert chain["text"] == ar["text"]
    flex = run_json(capfd, base_args(folders, "--attention", "flex"))  # eager reference form on the CPU
    assert flex["text"] == ar["text"]


def test_threshold_inf(folders, capfd):
    ar = run_json(capfd, base_args(folders, "--autoregressive"))
    for extra in (["--threshold", "inf"], ["--threshold", "inf", "--fuzzy-mode", "pure", "--divergence", "js"],
                  ["--threshold", "1", "--divergence", "tv", "--support-top-k", "5"]):
        d = run_json(capfd, base_args(folders, *extra))
        assert d["fuzzy_accepted"] > 0, extra
        assert d["tau"] > 2 and d["target_forwards"] < ar["target_forwards"]
        assert d["divergence_mean"] is not None


def test_stream_output_matches_json(folders, capfd):
    d = run_json(capfd, base_args(folders))
    rc, out, err = run_main(capfd, base_args(folders))
    assert rc == 0 and out == d["text"] + "\n"
    # stderr: one line of statistics, the same as --json's
    assert err == f"[{d['new_tokens']} tokens in " + err.split(" in ", 1)[1] and err.count("\n") == 1
    assert f"tau {d['tau']:.2f} ({d['target_forwards']} target forwards)" in err and "tokens/s" in err
    rc, out, _ = run_main(capfd, base_args(folders, "--stop", d["text"].split()[3]))
    assert rc == 0 and out == d["text"][: d["text"].index(d["text"].split()[3])] + "\n"


def test_threads_option(folders, capfd):
    """--threads N reaches SpeculativeGenerator.load, which applies it once."""
    before = torch.get_num_threads()
    try:
        assert run_json(capfd, base_args(folders, "--threads", "2"))["new_tokens"] > 0
        assert torch.get_num_threads() == 2
    finally:
        torch.set_num_threads(before)


def test_sampling_seed(folders, capfd):
    a = run_json(capfd, base_args(folders, "--temperature", "0.8", "--seed", "4"))
    b = run_json(capfd, base_args(folders, "--temperature", "0.8", "--seed", "4"))
    assert a["text"] == b["text"]


def test_python_m_json(runs):
    """The CLI run as a process (see DRIVER): clean stdout (one JSON object, or the text) and stderr empty
    with --json, one statistics line without."""
    r = runs["json"]
    assert r["rc"] == 0, r["err"]
    assert r["err"] == ""
    d = json.loads(r["out"])
    for key in KEYS:
        assert key in d
    assert d["fuzzy_accepted"] > 0
    r = runs["stream"]
    assert r["rc"] == 0 and r["out"] == d["text"] + "\n"
    assert r["err"].startswith(f"[{d['new_tokens']} tokens in ") and r["err"].count("\n") == 1
    assert f"{d['fuzzy_accepted']} fuzzy-accepted]" in r["err"] and "Traceback" not in r["err"]


# ------------------------------------------------------------------------------------ bad input

DRIVER = r"""
import json, os, runpy, sys, traceback
import torch, transformers, fsd_eagle.api  # the heavy imports, once, before forking
from transformers import AutoModelForCausalLM, AutoTokenizer

results = []
for i, (module, argv) in enumerate(json.loads(sys.argv[1])):
    out, err = f"{sys.argv[2]}/{i}.out", f"{sys.argv[2]}/{i}.err"
    pid = os.fork()
    if pid == 0:
        os.dup2(os.open(out, os.O_WRONLY | os.O_CREAT), 1)
        os.dup2(os.open(err, os.O_WRONLY | os.O_CREAT), 2)
        sys.argv = [module, *argv]
        code = 0
        try:
            runpy.run_module(module, run_name="__main__", alter_sys=True)
        except SystemExit as e:  # what the interpreter does with SystemExit and uncaught exceptions
            code = e.code if isinstance(e.code, int) else (0 if e.code is None else 1)
            if isinstance(e.code, str):
                print(e.code, file=sys.stderr)
        except BaseException:
            traceback.print_exc()
            code = 1
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)
    status = os.waitpid(pid, 0)[1]
    results.append({"rc": os.waitstatus_to_exitcode(status), "out": open(out).read(), "err": open(err).read()})
print(json.dumps(results))
"""


def corrupt_target(folders):
    folder = folders / "corrupt_target"
    if not folder.exists():
        shutil.copytree(folders / "target", folder)
        (folder / "model.safetensors").write_bytes(b"garbage" * 10)
    return folder


def bad_cases(folders):
    missing = str(folders / "no_such_model")
    no_config = folders / "no_config"
    no_config.mkdir(exist_ok=True)
    cases = {
        "empty prompt": ["generate", "", *base_args(folders)[2:]],
        "blank prompt": ["generate", "  \n ", *base_args(folders)[2:]],
        "max-new-tokens 0": base_args(folders, "--max-new-tokens", "0"),
        "max-new-tokens -3": base_args(folders, "--max-new-tokens", "-3"),
        "device tpu": base_args(folders, "--device", "tpu"),
        "dtype int3": base_args(folders, "--dtype", "int3"),
        "threshold -1": base_args(folders, "--threshold", "-1"),
        "threshold abc": base_args(folders, "--threshold", "abc"),
        "threshold nan": base_args(folders, "--threshold", "nan"),
        "divergence foo": base_args(folders, "--divergence", "foo"),
        "fuzzy-mode bad": base_args(folders, "--fuzzy-mode", "strict"),
        "support-top-k -1": base_args(folders, "--support-top-k", "-1"),
        "temperature -1": base_args(folders, "--temperature", "-1"),
        "top-p 0": base_args(folders, "--top-p", "0"),
        "tree-top-k 0": base_args(folders, "--tree-top-k", "0"),
        "depth 0": base_args(folders, "--depth", "0"),
        "draft-vocab -1": base_args(folders, "--draft-vocab", "-1"),
        "draft-vocab without a ranking": base_args(folders, "--draft-vocab", "32"),
        "threads 0": base_args(folders, "--threads", "0"),
        "threads -2": base_args(folders, "--threads", "-2"),
        "missing target": ["generate", PROMPT, "--target", missing, "--device", "cpu", "--json"],
        "target without config": ["generate", PROMPT, "--target", str(no_config), "--device", "cpu"],
        "missing head": base_args(folders, head=False) + ["--head", missing],
        "head is the target": base_args(folders, head=False) + ["--head", str(folders / "target")],
        "corrupt target weights": ["generate", PROMPT, "--target", str(corrupt_target(folders)), "--device", "cpu"],
    }
    if not torch.cuda.is_available():
        cases["device cuda"] = base_args(folders, "--device", "cuda")
    assert set(cases) <= {c if isinstance(c, str) else c.values[0] for c in BAD_CASES}
    return cases


@pytest.fixture(scope="module")
def runs(folders, tmp_path_factory):
    """Every process case in one go (one import of torch and transformers)."""
    scratch = tmp_path_factory.mktemp("cli_runs")
    cases = {name: ("fsd_eagle.cli", argv) for name, argv in bad_cases(folders).items()}
    cases["json"] = ("fsd_eagle.cli", base_args(folders, "--threshold", "inf", "--json"))
    cases["stream"] = ("fsd_eagle.cli", base_args(folders, "--threshold", "inf"))
    cases["control"] = ("fsd_eagle.no_such_module", ["generate", "x"])  # a traceback must be seen
    proc = subprocess.run([sys.executable, "-c", DRIVER, json.dumps(list(cases.values())), str(scratch)],
                          capture_output=True, text=True, env=ENV, timeout=300)
    assert proc.returncode == 0, proc.stderr
    return dict(zip(cases, json.loads(proc.stdout.splitlines()[-1])))


def test_driver_reports_tracebacks(runs):
    """The fork driver can fail a case: an uncaught exception gives rc 1 and a traceback."""
    control = runs["control"]
    assert control["rc"] == 1 and "Traceback" in control["err"]


BAD_CASES = ["empty prompt", "blank prompt", "max-new-tokens 0", "max-new-tokens -3", "device tpu", "dtype int3",
             "threshold -1", "threshold abc", "threshold nan", "divergence foo", "fuzzy-mode bad",
             "support-top-k -1", "temperature -1", "top-p 0", "tree-top-k 0", "depth 0", "draft-vocab -1",
             "draft-vocab without a ranking", "threads 0", "threads -2", "missing target",
             "target without config", "missing head", "head is the target", "device cuda",
             "corrupt target weights"]


@pytest.mark.parametrize("case", BAD_CASES)
def test_bad_input_one_error_line(runs, case):
    if case not in runs:
        pytest.skip("CUDA is available here")
    r = runs[case]
    assert r["rc"] != 0, r
    assert "Traceback" not in r["err"]
    lines = r["err"].splitlines()
    assert len(lines) == 1, r["err"]
    assert lines[0].startswith("error: ") and len(lines[0]) > len("error: ")
    assert r["out"] == ""


def test_argparse_errors_have_no_traceback(capfd):
    with pytest.raises(SystemExit) as info:
        main(["generate", PROMPT, "--max-new-tokens", "many"])
    assert info.value.code == 2
    _, err = capfd.readouterr()
    assert "Traceback" not in err and "error:" in err.splitlines()[-1]


def test_version(capsys):
    import fsd_eagle

    with pytest.raises(SystemExit) as info:
        main(["--version"])
    assert info.value.code == 0 and capsys.readouterr().out == f"fsd-eagle {fsd_eagle.__version__}\n"

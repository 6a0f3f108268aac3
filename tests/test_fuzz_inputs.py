"""Bad input of every kind ends with one readable line (docs/hardening.md, item 7): the command lines exit with
status 2 and exactly one ``error: ...`` line on stderr, no traceback, nothing on stdout and nothing written;
the Python API raises an FSDError whose message is one line. A table of the cases found by hand (pickles,
malformed head configs, text that is not UTF-8, tokenizers beyond the model's vocabulary, chat messages
without role or content, extreme numbers, oversized draft vocabularies and trees, argparse errors) and
hypothesis over the numbers and structures; Ctrl-C at any moment prints "interrupted" and exits with 130.
Command lines run in-process (tiny models from configs); the Ctrl-C cases run as real processes."""

from __future__ import annotations

import json
import math
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from safetensors.torch import load_file, save_file

import fsd_eagle.cli as cli
import training.__main__ as training_main
from fsd_eagle.api import SpeculativeGenerator
from fsd_eagle.config import FuzzyConfig, TreeConfig
from fsd_eagle.errors import FSDError
from fsd_eagle.models import load_head, save_ranking
from test_api import EOS, PROMPT, TREE, make_llama, make_tokenizer, noisy_copy, save_target_and_head
from training.recipe import Recipe

torch.set_num_threads(1)

ROOT = Path(__file__).resolve().parents[1]
FUZZ = settings(max_examples=40, deadline=None, suppress_health_check=list(HealthCheck), derandomize=True)


class Shell:
    """Pickles as a call of os.system: what a malicious pytorch_model.bin holds."""

    def __reduce__(self):
        return os.system, ("true",)


@pytest.fixture(scope="module")
def folders(tmp_path_factory) -> Path:
    """The tiny target and a head with a token ranking, plus broken variants of both."""
    root = save_target_and_head(tmp_path_factory.mktemp("fuzz"), head_seed=3)
    save_ranking(torch.arange(128).flip(0), root / "head")
    head_config = json.loads((root / "head" / "config.json").read_text())

    def head_variant(name: str, config=None, weights: bytes | None = None, pickled=None) -> None:
        folder = root / name
        shutil.copytree(root / "head", folder)
        if config is not None:
            (folder / "config.json").write_text(config if isinstance(config, str) else json.dumps(config))
        if weights is not None or pickled is not None:
            (folder / "model.safetensors").unlink()
            if pickled is not None:
                torch.save(pickled, folder / "pytorch_model.bin")
            else:
                (folder / "pytorch_model.bin").write_bytes(weights)

    head_variant("head_pickle_global", pickled={"fc.weight": Shell()})
    head_variant("head_pickle_list", pickled=[1, 2, 3])
    head_variant("head_pickle_garbage", weights=b"\x80\x04\x95garbage pickle bytes" * 5)
    head_variant("head_pickle_empty", weights=b"abc")
    head_variant("head_list_config", config="[1, 2]")
    head_variant("head_string_size", config={**head_config, "hidden_size": "64"})
    head_variant("head_zero_heads", config={**head_config, "num_attention_heads": 0})
    head_variant("head_rope_without_factor", config={**head_config, "rope_parameters": {"rope_type": "linear"}})
    head_variant("head_string_eps", config={**head_config, "rms_norm_eps": "1e-6"})
    head_variant("head_nan_eps", config=json.dumps({**head_config, "rms_norm_eps": float("nan")}))
    head_variant("head_not_utf8", config=json.dumps(head_config).encode("utf-16").decode("latin-1"))

    big_tokenizer = root / "target_big_tokenizer"
    make_llama(seed=0, vocab=64).save_pretrained(big_tokenizer)
    make_tokenizer(128).save_pretrained(big_tokenizer)
    remote = root / "target_remote_code"
    shutil.copytree(root / "target", remote)
    (remote / "custom.py").write_text(f"open({str(root / 'code_ran')!r}, 'w').write('ran')\n")
    config = json.loads((remote / "config.json").read_text())
    (remote / "config.json").write_text(json.dumps({**config, "model_type": "custom", "auto_map": {
        "AutoConfig": "custom.C", "AutoModelForCausalLM": "custom.M"}}))
    missing = root / "target_missing_layer"
    shutil.copytree(root / "target", missing)
    state = load_file(missing / "model.safetensors")
    save_file({k: v for k, v in state.items() if ".layers.1." not in k}, missing / "model.safetensors",
              metadata={"format": "pt"})
    (root / "latin1.jsonl").write_bytes('{"messages": [{"role": "user", "content": "caf\u00e9"}]}\n'.encode("latin-1"))
    return root


def generate_argv(folders: Path, *extra, target: str = "target", head: str | None = "head", prompt: str = PROMPT):
    argv = ["generate", prompt, "--target", str(folders / target), "--device", "cpu", "--dtype", "float32",
            "--max-new-tokens", "4", "--total-tokens", "6", "--depth", "3", "--tree-top-k", "2", "--json"]
    return argv + (["--head", str(folders / head)] if head else []) + [str(x) for x in extra]


def run_cli(main, argv, capfd, where: Path) -> tuple[int, str, str]:
    """Run a command line's main in-process in ``where``: (exit status, stdout, stderr); argparse's exits
    count as the status they carry."""
    before = sorted(where.rglob("*"))
    capfd.readouterr()
    try:
        rc = main(argv)
    except SystemExit as e:
        rc = e.code
    out, err = capfd.readouterr()
    assert sorted(where.rglob("*")) == before, "the command wrote files"
    return rc, out, err


def assert_one_error_line(rc, out: str, err: str) -> str:
    assert rc == 2, (rc, err)
    assert "Traceback" not in err
    lines = err.splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: ") and len(lines[0]) > 10, err
    assert out == ""
    return lines[0]


# --------------------------------------------------------------------------------- the command line: cases

GENERATE_CASES = {
    # numbers: extreme, out of range, not a number
    "temperature 1e308": (["--temperature", "1e308"], "temperature must be 0 (greedy) or between"),
    "temperature 1e-300": (["--temperature", "1e-300"], "temperature must be 0 (greedy) or between"),
    "temperature inf": (["--temperature", "inf"], "temperature must be a finite number"),
    "temperature nan": (["--temperature", "nan"], "temperature must be a finite number"),
    "top-p nan": (["--top-p", "nan"], "top_p must be in (0, 1]"),
    "top-p 1e-300": (["--top-p", "1e-300", "--temperature", "1"], "top_p must be at least"),
    "top-p 2": (["--top-p", "2"], "top_p must be in (0, 1]"),
    "top-k -1": (["--top-k", "-1"], "top_k must be an integer from 0 to 2**31 - 1"),
    "top-k 10**30 sampling": (["--temperature", "0.8", "--top-k", str(10 ** 30)], "top_k must be an integer from 0"),
    "max-new-tokens 0": (["--max-new-tokens", "0"], "--max-new-tokens must be at least 1"),
    "seed 10**30": (["--seed", str(10 ** 30)], "--seed must be an integer from"),
    "seed -2**70": (["--seed", str(-2 ** 70)], "--seed must be an integer from"),
    "total-tokens 10**9": (["--total-tokens", str(10 ** 9)], "does not fit the model's context"),
    "depth 10**9": (["--depth", str(10 ** 9)], "does not fit the model's context"),
    "tree-top-k 10**9": (["--tree-top-k", str(10 ** 9)], "exceeds the vocabulary size"),
    "draft-vocab 1000 (vocabulary 128)": (["--draft-vocab", "1000"], "draft_vocab 1000 exceeds the vocabulary size 128"),
    "draft-vocab -1": (["--draft-vocab", "-1"], "draft_vocab must be an integer >= 0"),
    "threshold nan": (["--threshold", "nan"], "threshold must be finite"),
    "threshold 1e999": (["--threshold", "1e999"], "threshold must be finite"),
    "support-top-k -1": (["--support-top-k", "-1"], "support_top_k must be an integer >= 0"),
    "max-new-tokens many (argparse)": (["--max-new-tokens", "many"], "invalid int value"),
    "unknown option (argparse)": (["--temprature", "1"], "unrecognized arguments"),
    "attention bad (argparse)": (["--attention", "magic"], "invalid choice"),
}
FOLDER_CASES = {
    "head pickle of os.system": ("head", "head_pickle_global", "not a plain weights file"),
    "head pickle of a list": ("head", "head_pickle_list", "does not hold weights"),
    "head garbage pickle": ("head", "head_pickle_garbage", "not a plain weights file"),
    "head 3-byte pickle": ("head", "head_pickle_empty", "not a plain weights file"),
    "head config is a list": ("head", "head_list_config", "must hold a JSON object"),
    "head hidden_size '64'": ("head", "head_string_size", "hidden_size must be an integer >= 1, got '64'"),
    "head zero heads": ("head", "head_zero_heads", "num_attention_heads must be an integer >= 1"),
    "head rope without factor": ("head", "head_rope_without_factor", "rope_parameters"),
    "head eps '1e-6'": ("head", "head_string_eps", "rms_norm_eps must be a number > 0"),
    "head eps NaN": ("head", "head_nan_eps", "rms_norm_eps must be a number > 0"),
    "head config not UTF-8": ("head", "head_not_utf8", "not valid JSON"),
    "target with auto_map": ("target", "target_remote_code", "auto_map"),
    "target missing a layer": ("target", "target_missing_layer", "the weights lack"),
    "tokenizer beyond the vocabulary": ("target", "target_big_tokenizer", "outside the model's vocabulary (size 64)"),
}


@pytest.mark.parametrize("case", list(GENERATE_CASES))
def test_generate_bad_values(folders, capfd, tmp_path, monkeypatch, case):
    extra, expected = GENERATE_CASES[case]
    monkeypatch.chdir(tmp_path)
    line = assert_one_error_line(*run_cli(cli.main, generate_argv(folders, *extra), capfd, tmp_path))
    assert expected in line, line


@pytest.mark.parametrize("case", list(FOLDER_CASES))
def test_generate_bad_folders(folders, capfd, tmp_path, monkeypatch, case):
    kind, name, expected = FOLDER_CASES[case]
    argv = generate_argv(folders, head=name) if kind == "head" else generate_argv(folders, target=name, head=None,
                                                                                   prompt="w5 w100")
    monkeypatch.chdir(tmp_path)
    line = assert_one_error_line(*run_cli(cli.main, argv, capfd, tmp_path))
    assert expected in line, line
    assert not (folders / "code_ran").exists()


def test_generate_prompt_that_is_not_utf8(folders, capfd, tmp_path, monkeypatch):
    """Bytes of a command line that are not UTF-8 reach Python as lone surrogates."""
    monkeypatch.chdir(tmp_path)
    line = assert_one_error_line(*run_cli(cli.main, generate_argv(folders, prompt=b"w5 \xff\xfe".decode(
        "utf-8", "surrogateescape")), capfd, tmp_path))
    assert "not valid UTF-8" in line


def test_training_data_that_is_not_utf8(folders, capfd, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    argv = ["data", "prepare", "--out", str(tmp_path / "out.jsonl"), "--jsonl", str(folders / "latin1.jsonl")]
    line = assert_one_error_line(*run_cli(training_main.main, argv, capfd, tmp_path))
    assert "cannot decode" in line


@FUZZ
@given(flag=st.sampled_from(["--temperature", "--top-p", "--top-k", "--max-new-tokens", "--seed", "--total-tokens",
                             "--depth", "--tree-top-k", "--draft-vocab", "--threshold", "--support-top-k"]),
       value=st.one_of(st.floats(allow_nan=True, allow_infinity=True).map(repr),
                       st.integers(min_value=-2 ** 80, max_value=2 ** 80).map(str),
                       st.sampled_from(["", "x", "1e999", "-0", "0x10", "1_0"])))
def test_generate_numbers_fuzz(folders, capfd, tmp_path_factory, flag, value):
    """Any value of a numeric option either generates (JSON on stdout, nothing on stderr) or is refused with
    one line."""
    where = tmp_path_factory.mktemp("cwd")
    rc, out, err = run_cli(cli.main, generate_argv(folders, flag, value), capfd, where)
    if rc == 0:
        assert err == "" and "text" in json.loads(out)
    else:
        assert_one_error_line(rc, out, err)


def test_usage_errors_of_every_command_line_are_one_line(capfd, tmp_path):
    from eval.__main__ import main as eval_main

    for main, argv in ((cli.main, ["generate"]), (cli.main, ["frobnicate"]), (training_main.main, ["run"]),
                       (training_main.main, ["data", "prepare"]), (eval_main, ["sweep", "--workers", "x"])):
        assert_one_error_line(*run_cli(main, argv, capfd, tmp_path))


# -------------------------------------------------------------------------------------------- Ctrl-C


class InterruptingImport:
    """A meta path finder that raises KeyboardInterrupt when ``name`` is imported: a Ctrl-C that strikes
    while a command line loads its heavy modules."""

    def __init__(self, name: str) -> None:
        self.name = name

    def find_spec(self, fullname, path=None, target=None):
        if fullname == self.name:
            raise KeyboardInterrupt
        return None


@pytest.mark.parametrize("command", ["fsd-eagle", "training", "training data", "eval"])
def test_ctrl_c_while_a_command_line_loads(monkeypatch, capfd, command):
    from eval.__main__ import main as eval_main

    main, argv, module = {"fsd-eagle": (cli.main, ["generate", "hello"], "fsd_eagle.api"),
                          "training": (training_main.main, ["run", "recipe.json", "--out", "x"], "training.cli"),
                          "training data": (training_main.main, ["data", "prepare", "--out", "x", "--gsm8k"],
                                            "training.cli"),
                          "eval": (eval_main, ["tau", "--limit", "1"], "eval.tau")}[command]
    monkeypatch.delitem(sys.modules, module, raising=False)
    monkeypatch.setattr(sys, "meta_path", [InterruptingImport(module), *sys.meta_path])
    capfd.readouterr()
    assert main(argv) == 130
    out, err = capfd.readouterr()
    assert err.strip().splitlines() == [err.strip()] and err.strip().startswith("interrupted") and out == ""


HOLD_TORCH_IMPORT = """
import os, sys, time

class HoldTorch:
    # Marks the moment torch starts loading (a file), then holds that import for a few seconds.
    def find_spec(self, name, path=None, target=None):
        if name == "torch":
            sys.meta_path.remove(self)
            open(os.environ["FSD_EAGLE_TEST_LOADING"], "w").close()
            time.sleep(10)
        return None

sys.meta_path.insert(0, HoldTorch())
"""


def test_ctrl_c_of_the_real_command_line(folders, tmp_path):
    """SIGINT to ``python -m fsd_eagle.cli`` while it loads torch (a sitecustomize holds that import until
    the signal comes, so the test does not depend on how fast the machine loads): exit status 130 and the
    one line "interrupted" (not a 34-line traceback)."""
    hook, loading = tmp_path / "hook", tmp_path / "loading"
    hook.mkdir()
    (hook / "sitecustomize.py").write_text(HOLD_TORCH_IMPORT)
    env = dict(os.environ, PYTHONPATH=f"{hook}{os.pathsep}{ROOT}", OMP_NUM_THREADS="1", HF_HUB_OFFLINE="1",
               FSD_EAGLE_TEST_LOADING=str(loading))
    # A shell that starts the test run in the background makes its children ignore SIGINT, and Python then
    # leaves it ignored: the command line gets SIGINT's default disposition back, as a terminal would give it.
    proc = subprocess.Popen([sys.executable, "-m", "fsd_eagle.cli", *generate_argv(folders)], cwd=tmp_path, env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))
    deadline = time.monotonic() + 60
    while not loading.exists() and proc.poll() is None and time.monotonic() < deadline:
        time.sleep(0.02)
    assert loading.exists(), "the command line did not start loading torch"
    proc.send_signal(signal.SIGINT)
    out, err = proc.communicate(timeout=60)
    assert (proc.returncode, err, out) == (130, b"interrupted\n", b"")


# ---------------------------------------------------------------------------------------- the Python API


@pytest.fixture(scope="module")
def gen():
    model = make_llama(seed=0)
    return SpeculativeGenerator(model, make_tokenizer(), draft_model=noisy_copy(model), tree=TREE)


def one_line(error: BaseException) -> None:
    assert isinstance(error, FSDError), repr(error)
    message = str(error)
    assert message and "\n" not in message


API_CASES = {
    "chat message without content": lambda g: g.generate([{"role": "user"}], 4),
    "chat message without role": lambda g: g.generate([{"content": "w5"}], 4),
    "chat message content 5": lambda g: g.generate([{"role": "user", "content": 5}], 4),
    "chat message content not UTF-8": lambda g: g.generate([{"role": "user", "content": "w5 \udcff"}], 4),
    "prompt not UTF-8": lambda g: g.generate("w5 \udcff", 4),
    "token id 10**20": lambda g: g.generate([5, 10 ** 20], 4),
    "temperature 1e308": lambda g: g.generate(PROMPT, 4, temperature=1e308),
    "temperature 1e-300": lambda g: g.generate(PROMPT, 4, temperature=1e-300),
    "top_p nan": lambda g: g.generate(PROMPT, 4, temperature=1.0, top_p=math.nan),
    "top_p 1e-300": lambda g: g.generate(PROMPT, 4, temperature=1.0, top_p=1e-300),
    "max_new_tokens 0": lambda g: g.generate(PROMPT, 0),
    "draft_vocab 10**6": lambda g: g.set_tree(6, 3, 2, 10 ** 6),
    "tree beyond the context": lambda g: g.set_tree(10 ** 6, 3, 2),
    "tree of strings": lambda g: g.set_tree("6", 3, 2),
    "fuzzy threshold nan": lambda g: g.generate(PROMPT, 4, fuzzy=FuzzyConfig(threshold=math.nan)),
    "fuzzy threshold 10**400": lambda g: g.generate(PROMPT, 4, fuzzy=FuzzyConfig(threshold=10 ** 400)),
    "fuzzy processed 'no'": lambda g: g.generate(PROMPT, 4, fuzzy=FuzzyConfig(processed="no")),
    "temperature 10**400": lambda g: g.generate(PROMPT, 4, temperature=10 ** 400),
    "top_p 10**400": lambda g: g.generate(PROMPT, 4, temperature=1.0, top_p=10 ** 400),
    "top_k 2**70": lambda g: g.generate(PROMPT, 4, temperature=0.8, top_k=2 ** 70),
    "seed 2**70": lambda g: g.generate(PROMPT, 4, temperature=0.8, seed=2 ** 70),
    "seed -2**70 in a list": lambda g: g.generate([PROMPT, PROMPT], 4, temperature=0.8, seed=[0, -2 ** 70]),
}


@pytest.mark.parametrize("case", list(API_CASES))
def test_api_bad_values(gen, case):
    tree = gen.tree
    with pytest.raises(FSDError) as info:
        API_CASES[case](gen)
    one_line(info.value)
    assert gen.tree == tree  # a refused call changes nothing
    assert gen.generate(PROMPT, 4).token_ids  # and the generator still works


JSONISH = st.recursive(st.none() | st.booleans() | st.integers(min_value=-2 ** 70, max_value=2 ** 70)
                       | st.floats(allow_nan=True, allow_infinity=True) | st.text(max_size=6),
                       lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=6), inner, max_size=3),
                       max_leaves=6)


@FUZZ
@given(temperature=st.one_of(st.floats(allow_nan=True, allow_infinity=True), st.integers(-5, 5), st.text(max_size=3)),
       top_p=st.floats(allow_nan=True, allow_infinity=True), top_k=st.integers(min_value=-2 ** 70, max_value=2 ** 70),
       max_new_tokens=st.one_of(st.integers(min_value=-2 ** 70, max_value=2 ** 70), st.floats()),
       stop=st.one_of(st.none(), st.text(max_size=4), st.lists(JSONISH, max_size=2)),
       threshold=st.floats(allow_nan=True, allow_infinity=True))
def test_api_generate_arguments_fuzz(gen, temperature, top_p, top_k, max_new_tokens, stop, threshold):
    """Whatever the arguments: a result, or an FSDError with one line."""
    if isinstance(max_new_tokens, int) and max_new_tokens > 0:
        max_new_tokens = min(max_new_tokens, 6)  # a valid huge value is clipped to the context: keep it short
    try:
        fuzzy = FuzzyConfig(threshold=threshold)
        result = gen.generate(PROMPT, max_new_tokens, temperature=temperature, top_p=top_p, top_k=top_k, stop=stop,
                              fuzzy=fuzzy, seed=1)
    except FSDError as e:
        one_line(e)
    else:
        assert len(result.token_ids) <= 6 and EOS not in result.token_ids


@FUZZ
@given(prompt=st.one_of(st.text(st.characters(codec=None), max_size=8),
                        st.lists(st.integers(min_value=-2 ** 70, max_value=2 ** 70), max_size=4),
                        st.lists(st.dictionaries(st.sampled_from(["role", "content", "name"]), JSONISH, max_size=3),
                                 max_size=2),
                        JSONISH))
def test_api_prompt_fuzz(gen, prompt):
    try:
        gen.generate(prompt, 3)
    except FSDError as e:
        one_line(e)


HEAD_FIELDS = ["hidden_size", "intermediate_size", "num_attention_heads", "num_key_value_heads", "vocab_size",
               "head_dim", "rms_norm_eps", "rope_parameters", "format"]


@FUZZ
@given(changes=st.dictionaries(st.sampled_from(HEAD_FIELDS), JSONISH | st.integers(0, 300), max_size=3))
def test_head_config_fuzz(folders, tmp_path_factory, changes):
    """Any head config.json values: the head loads (and fits) or loading raises one line, never allocating
    what a huge size asks for (shapes are compared on the meta device first)."""
    from transformers import AutoConfig

    folder = tmp_path_factory.mktemp("head")
    shutil.copy(folders / "head" / "model.safetensors", folder)
    config = json.loads((folders / "head" / "config.json").read_text())
    (folder / "config.json").write_text(json.dumps({**config, **changes}))
    target_config = AutoConfig.from_pretrained(folders / "target", trust_remote_code=False)
    try:
        head = load_head(folder, target_config, torch.device("cpu"), torch.float32)
    except FSDError as e:
        one_line(e)
    else:
        assert head.config.hidden_size == 64


RECIPE_FIELDS = ["epochs", "lr", "checkpoint_every", "tokens_per_batch", "max_len", "betas", "val_fraction", "seed",
                 "unroll", "unroll_decay", "noise", "grad_clip", "answers", "distill", "data", "warmup_steps",
                 "arch", "layers", "draft_vocab_size"]


@settings(max_examples=150, deadline=None, derandomize=True)
@given(changes=st.dictionaries(st.sampled_from(RECIPE_FIELDS), JSONISH, max_size=3))
def test_recipe_fuzz(tmp_path_factory, changes):
    """Any recipe values: the recipe loads with usable values, or is refused with one line."""
    path = tmp_path_factory.mktemp("recipe") / "recipe.json"
    path.write_text(json.dumps(changes))
    try:
        recipe = Recipe.load(path)
    except FSDError as e:
        one_line(e)
    else:
        assert recipe.epochs >= 1 and math.isfinite(recipe.lr) and recipe.lr >= 0 and recipe.checkpoint_every >= 1
        assert 0 <= recipe.val_fraction < 1 and all(0 <= b < 1 for b in recipe.betas)


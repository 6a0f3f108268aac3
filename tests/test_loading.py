"""Loading refuses what would otherwise load silently or run foreign code (docs/hardening.md, items 2-4):
incomplete or mismatched target weights (checked against the safetensors headers before the model is built,
else against transformers' loading report), model folders with their own code (``auto_map``), and head
configs whose implied shapes differ from the weights (checked on a meta-device head, before allocation)."""

from __future__ import annotations

import ast
import json
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

import fsd_eagle.models as models
from fsd_eagle.api import SpeculativeGenerator
from fsd_eagle.errors import FSDError, HeadMismatchError, ModelLoadError
from fsd_eagle.head import EagleHead
from test_api import PROMPT, TREE, make_llama, make_tokenizer, save_target_and_head

torch.set_num_threads(1)

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    return save_target_and_head(tmp_path_factory.mktemp("loading"), head_seed=2)


def variant(saved, tmp_path, name: str) -> Path:
    folder = tmp_path / name
    shutil.copytree(saved / "target", folder)
    return folder


def edit_config(folder: Path, **changes) -> None:
    path = folder / "config.json"
    path.write_text(json.dumps({**json.loads(path.read_text()), **changes}))


def keep_weights(folder: Path, keep) -> None:
    state = load_file(folder / "model.safetensors")
    save_file({k: v for k, v in state.items() if keep(k)}, folder / "model.safetensors", metadata={"format": "pt"})


def load(target, head=None):
    return SpeculativeGenerator.load(target=target, head=head, device="cpu", dtype="float32", tree=TREE)


def refused(target=None, head=None, error=ModelLoadError, target_dir=None) -> str:
    with pytest.raises(error) as info:
        load(target if target is not None else target_dir, head)
    msg = str(info.value)
    assert isinstance(info.value, FSDError) and msg and "\n" not in msg
    return msg


@pytest.fixture
def builds(monkeypatch):
    """Records the device of every model and head really built (a meta-device build allocates nothing)."""
    from transformers import AutoModelForCausalLM

    seen = []
    original = AutoModelForCausalLM.from_pretrained.__func__

    def from_pretrained(cls, *args, **kwargs):
        seen.append("target")
        return original(cls, *args, **kwargs)

    class Head(EagleHead):
        def __init__(self, cfg):
            seen.append(f"head on {torch.empty(0).device.type}")
            super().__init__(cfg)

    monkeypatch.setattr(AutoModelForCausalLM, "from_pretrained", classmethod(from_pretrained))
    monkeypatch.setattr(models, "EagleHead", Head)
    return seen


# ------------------------------------------------------------------------------------- 2: target weights


@pytest.mark.parametrize("case", ["layer 1 missing", "config asks for 3 layers", "intermediate_size 4096",
                                  "vocab_size 400,000,000"])
def test_incomplete_or_mismatched_target_refused_before_it_is_built(saved, tmp_path, builds, case):
    folder = variant(saved, tmp_path, "target")
    if case == "layer 1 missing":
        keep_weights(folder, lambda k: not k.startswith("model.layers.1."))
    elif case == "config asks for 3 layers":
        edit_config(folder, num_hidden_layers=3)
    elif case == "intermediate_size 4096":
        edit_config(folder, intermediate_size=4096)
    else:
        edit_config(folder, vocab_size=400_000_000)
    msg = refused(folder)
    assert str(folder) in msg
    assert ("lack" in msg and "model.layers." in msg) if "layer" in case else "in the weights but config.json" in msg
    assert builds == []  # nothing was allocated: the safetensors headers were enough


def test_incomplete_pickle_checkpoint_refused_from_the_loading_report(saved, tmp_path):
    """A pytorch_model.bin has no header to read shapes from: transformers' loading report decides."""
    folder = variant(saved, tmp_path, "target")
    state = load_file(folder / "model.safetensors")
    (folder / "model.safetensors").unlink()
    torch.save({k: v for k, v in state.items() if not k.startswith("model.layers.1.")}, folder / "pytorch_model.bin")
    assert "lacks weights for model.layers.1." in refused(folder)


def test_extra_tensors_refused(saved, tmp_path):
    """Weights of 2 layers under a config of 1: the second layer's tensors would be left unused."""
    folder = variant(saved, tmp_path, "target")
    edit_config(folder, num_hidden_layers=1)
    assert "no place for: model.layers.1." in refused(folder)


def test_tied_embeddings_load(tmp_path):
    """A checkpoint that stores the embedding once for a tied lm_head is complete."""
    model = make_llama(seed=4, tie_word_embeddings=True)
    model.save_pretrained(tmp_path / "tied")
    make_tokenizer().save_pretrained(tmp_path / "tied")
    assert "lm_head.weight" not in load_file(tmp_path / "tied" / "model.safetensors")
    gen = load(tmp_path / "tied")
    reference = SpeculativeGenerator(model, make_tokenizer(), tree=TREE).generate(PROMPT, 8).token_ids
    assert gen.generate(PROMPT, 8).token_ids == reference


# ------------------------------------------------------------------------------------------ 3: custom code


@pytest.mark.parametrize("where", ["config.json", "tokenizer_config.json"])
def test_a_folder_with_its_own_code_is_refused_without_running_it(saved, tmp_path, capfd, where):
    folder = variant(saved, tmp_path, "target")
    marker = tmp_path / "code_ran"
    (folder / "custom.py").write_text(f"open({str(marker)!r}, 'w').write('ran')\n"
                                      "from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast\n"
                                      "class Config(LlamaConfig):\n    model_type = 'custom_llama'\n"
                                      "class Model(LlamaForCausalLM):\n    config_class = Config\n"
                                      "class Tokenizer(PreTrainedTokenizerFast):\n    pass\n")
    if where == "config.json":
        edit_config(folder, model_type="custom_llama", auto_map={"AutoConfig": "custom.Config",
                                                                  "AutoModelForCausalLM": "custom.Model"})
    else:
        path = folder / where
        path.write_text(json.dumps({**json.loads(path.read_text()), "auto_map": {"AutoTokenizer": [None, "custom.Tokenizer"]}}))
    capfd.readouterr()
    msg = refused(folder)
    assert "auto_map" in msg and where in msg
    assert not marker.exists()
    assert capfd.readouterr().out == ""  # no question on stdout


def test_every_transformers_load_refuses_remote_code():
    """Each from_pretrained / from_config call in the package, the trainer, the benchmarks and the tuner passes
    trust_remote_code=False (transformers would otherwise ask on stdout, and run the code when told yes)."""
    calls = []
    for folder in ("fsd_eagle", "training", "eval", "trees"):
        for path in (ROOT / folder).rglob("*.py"):
            for node in ast.walk(ast.parse(path.read_text())):
                if isinstance(node, ast.Call) and getattr(node.func, "attr", "") in ("from_pretrained", "from_config"):
                    ok = any(k.arg == "trust_remote_code" and isinstance(k.value, ast.Constant) and k.value.value is False
                             for k in node.keywords)
                    calls.append((f"{path.relative_to(ROOT)}:{node.lineno}", ok))
    assert len(calls) >= 5
    assert [where for where, ok in calls if not ok] == []


# --------------------------------------------------------------------------------- 4: head config shapes


@pytest.mark.parametrize("changes, expected", [
    ({"intermediate_size": 100_000_000}, "layers.0.mlp"),
    ({"num_key_value_heads": 4}, "layers.0.self_attn.k_proj.weight"),
    ({"head_dim": 4096}, "layers.0.self_attn"),
])
def test_head_config_that_disagrees_with_its_weights_is_refused_before_allocation(saved, tmp_path, builds,
                                                                                  changes, expected):
    head = tmp_path / "head"
    shutil.copytree(saved / "head", head)
    config = json.loads((head / "config.json").read_text())
    (head / "config.json").write_text(json.dumps({**config, **changes}))
    msg = refused(saved / "target", head, HeadMismatchError)
    assert "wrongly shaped" in msg and expected in msg
    assert "head on cpu" not in builds and "head on meta" in builds


def test_a_fitting_head_is_built_once(saved, builds):
    gen = load(saved / "target", saved / "head")
    assert gen.drafter is not None and builds.count("head on cpu") == 1


def test_a_target_gets_the_head_shipped_for_its_folder_name(saved, tmp_path, monkeypatch):
    """Without --head, a target folder named like a shipped head's folder (as the converted default model and
    Gemma 3 270M are) decodes with that head, but only if the head fits the target's hidden size and
    vocabulary; any other folder decodes autoregressively, and --random-head or a draft model wins."""
    shipped = tmp_path / "heads"
    shutil.copytree(saved / "head", shipped / "known-target")
    monkeypatch.setattr(models, "HEADS_DIR", shipped)
    known = variant(saved, tmp_path, "known-target")
    gen = load(str(known))
    assert gen.engine.head is not None
    assert torch.equal(gen.engine.head.fc.weight, load(str(saved / "target"), str(saved / "head")).engine.head.fc.weight)
    assert load(str(saved / "target")).engine.head is None
    random = SpeculativeGenerator.load(target=str(known), random_head=True, device="cpu", dtype="float32", tree=TREE)
    assert not torch.equal(random.engine.head.fc.weight, gen.engine.head.fc.weight)
    edit_config(shipped / "known-target", vocab_size=7)
    assert load(str(known)).engine.head is None


def test_the_cached_default_model_decodes_plain_text(tmp_path, monkeypatch):
    """A converted default model whose tokenizer config asks for WordPiece clean-up (what transformers 5.17
    saves for the GGUF's BPE tokenizer) is rewritten to plain decoding when it is looked up, keeping the rest
    of the config; a config that does not ask is left byte for byte."""
    monkeypatch.setenv("FSD_EAGLE_CACHE", str(tmp_path))
    folder = tmp_path / models.DEFAULT_TARGET
    folder.mkdir()
    (folder / "model.safetensors").write_bytes(b"")
    config = {"clean_up_tokenization_spaces": True, "model_max_length": 8192, "eos_token": "<|im_end|>"}
    (folder / "tokenizer_config.json").write_text(json.dumps(config))
    assert models.default_target_path() == folder
    assert json.loads((folder / "tokenizer_config.json").read_text()) == dict(config, clean_up_tokenization_spaces=False)
    plain = json.dumps({"model_max_length": 8192}, indent=4)
    (folder / "tokenizer_config.json").write_text(plain)
    models.default_target_path()
    assert (folder / "tokenizer_config.json").read_text() == plain
    (folder / "tokenizer_config.json").write_text("{not json")  # left for the tokenizer's load to report
    assert models.default_target_path() == folder
    assert (folder / "tokenizer_config.json").read_text() == "{not json"


def test_a_tokenizer_saved_with_clean_up_is_converted_to_plain_decoding(tmp_path):
    """What the GGUF conversion does after saving the tokenizer: transformers loads the rewritten folder
    without clean-up."""
    from transformers import AutoTokenizer

    make_tokenizer().save_pretrained(tmp_path)
    config = json.loads((tmp_path / "tokenizer_config.json").read_text())
    (tmp_path / "tokenizer_config.json").write_text(json.dumps(dict(config, clean_up_tokenization_spaces=True)))
    models.keep_plain_decoding(tmp_path)
    tokenizer = AutoTokenizer.from_pretrained(tmp_path)
    assert tokenizer.clean_up_tokenization_spaces is False


@pytest.mark.parametrize("where,value", [("head", float("nan")), ("head", float("inf")), ("target", float("nan")),
                                         ("target", float("-inf"))])
def test_weights_that_are_not_finite_are_refused_naming_the_tensor(saved, tmp_path, where, value):
    """One NaN or infinity in any weight of the head or the target: refused at load with one line naming
    the file and tensor (before: greedy stayed exact, but sampled children decoded token 0 from a NaN head)."""
    folder = tmp_path / where
    shutil.copytree(saved / where, folder)
    weights = folder / "model.safetensors"
    state = load_file(weights)
    name = sorted(k for k, v in state.items() if v.is_floating_point() and v.dim() == 2)[0]
    state[name][0, 0] = value
    save_file(state, weights, metadata={"format": "pt"})
    msg = refused(target=folder if where == "target" else saved / "target", head=folder if where == "head" else
                  saved / "head")
    assert name in msg and "NaN or infinite" in msg and str(folder) in msg

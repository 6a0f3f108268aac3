"""Exporting a head (``python -m training export``) into the published EAGLE-3 layout, vLLM's speculators
format and our own: names, shapes, dtypes and config fields as the specifications say; every export loads
back and decodes the same tokens; what cannot be exported is refused with one line."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors import safe_open

from fsd_eagle.config import TreeConfig
from fsd_eagle.errors import ConfigError, HeadMismatchError, ModelLoadError
from fsd_eagle.export import write_head
from fsd_eagle.head import EagleHead, HeadConfig
from fsd_eagle.models import load_head, save_head
from training.cli import main as training_main

from conftest import decode_all, make_session, tiny_model
from test_eagle3 import eagle3_head

CPU = torch.device("cpu")
TREE = TreeConfig(total_tokens=12, depth=4, top_k=3)
DRAFT_VOCAB = 100

# The decoder layer's tensors in both layouts (published EAGLE-3 heads: "midlayer."; speculators,
# vllm-project/speculators src/speculators/models/eagle3/core.py and model_definitions.py: "layers.0.").
LAYER_KEYS = ["self_attn.q_proj.weight", "self_attn.k_proj.weight", "self_attn.v_proj.weight",
              "self_attn.o_proj.weight", "mlp.gate_proj.weight", "mlp.up_proj.weight", "mlp.down_proj.weight",
              "input_layernorm.weight", "hidden_norm.weight", "post_attention_layernorm.weight"]
HEAD_KEYS = ["fc.weight", "norm.weight", "lm_head.weight", "d2t", "t2d"]
EXPECTED_KEYS = {"eagle3": sorted(HEAD_KEYS + ["midlayer." + k for k in LAYER_KEYS]),
                 "speculators": sorted(HEAD_KEYS + ["layers.0." + k for k in LAYER_KEYS])}
# Eagle3SpeculatorConfig (vllm-project/speculators src/speculators/models/eagle3/config.py) and
# SpeculatorModelConfig / SpeculatorsConfig (src/speculators/config.py) fields.
SPECULATORS_FIELDS = {"speculators_model_type", "speculators_version", "speculators_config", "architectures",
                      "transformer_layer_config", "draft_vocab_size", "norm_before_residual",
                      "target_hidden_size", "eagle_aux_hidden_state_layer_ids"}


@pytest.fixture(scope="module")
def model():
    return tiny_model("llama", num_layers=4, max_position_embeddings=1024)


def expected_shapes(c, layer: str) -> dict[str, tuple[int, ...]]:
    """Each tensor's shape for a head of hidden size h over target config ``c`` (3 fused layers)."""
    h, i, v = c.hidden_size, c.intermediate_size, c.vocab_size
    kv = c.num_key_value_heads * (h // c.num_attention_heads)
    shapes = {"fc.weight": (h, 3 * h), "norm.weight": (h,), "lm_head.weight": (DRAFT_VOCAB, h),
              "d2t": (DRAFT_VOCAB,), "t2d": (v,)}
    layer_shapes = {"self_attn.q_proj.weight": (h, 2 * h), "self_attn.k_proj.weight": (kv, 2 * h),
                    "self_attn.v_proj.weight": (kv, 2 * h), "self_attn.o_proj.weight": (h, h),
                    "mlp.gate_proj.weight": (i, h), "mlp.up_proj.weight": (i, h), "mlp.down_proj.weight": (h, i),
                    "input_layernorm.weight": (h,), "hidden_norm.weight": (h,),
                    "post_attention_layernorm.weight": (h,)}
    return shapes | {layer + k: s for k, s in layer_shapes.items()}


def saved_head(model, tmp_path, arch: str = "eagle3"):
    head = eagle3_head(model.config, DRAFT_VOCAB) if arch == "eagle3" else \
        EagleHead(HeadConfig.for_target(model.config)).float().eval()
    save_head(head, tmp_path / "head", torch.float32)
    return head, tmp_path / "head"


def export(*args: str) -> int:
    return training_main(["export", *map(str, args)])


@pytest.mark.parametrize("fmt,layer", [("eagle3", "midlayer."), ("speculators", "layers.0.")])
def test_export_writes_the_published_keys_shapes_dtypes_and_config(model, tmp_path, fmt, layer):
    head, folder = saved_head(model, tmp_path)
    assert export(folder, "--format", fmt, "--out", tmp_path / "out") == 0
    out = tmp_path / "out"
    assert sorted(p.name for p in out.iterdir()) == [".fsd-eagle", "config.json", "model.safetensors"]  # + our mark
    shapes = expected_shapes(model.config, layer)
    with safe_open(out / "model.safetensors", framework="pt") as f:
        assert sorted(f.keys()) == EXPECTED_KEYS[fmt]
        for key in f.keys():
            t = f.get_tensor(key)
            assert tuple(t.shape) == shapes[key], key
            assert t.dtype == {"d2t": torch.int64, "t2d": torch.bool}.get(key, torch.float32), key
        assert torch.equal(f.get_tensor("d2t"), head.d2t) and torch.equal(f.get_tensor("t2d"), head.t2d)
    raw = json.loads((out / "config.json").read_text())
    c = model.config
    layer_config = raw if fmt == "eagle3" else raw["transformer_layer_config"]
    for key in ("hidden_size", "intermediate_size", "num_attention_heads", "num_key_value_heads", "vocab_size"):
        assert layer_config[key] == getattr(c, key), key
    assert layer_config["head_dim"] == c.hidden_size // c.num_attention_heads
    assert layer_config["num_hidden_layers"] == 1 and layer_config["rope_theta"] == c.rope_parameters["rope_theta"]
    assert layer_config["rms_norm_eps"] == head.config.rms_norm_eps
    if fmt == "eagle3":
        assert raw["architectures"] == ["LlamaForCausalLMEagle3"] and raw["draft_vocab_size"] == DRAFT_VOCAB
        assert raw["eagle_config"] == {"eagle_aux_hidden_state_layer_ids": list(head.config.layers)}
    else:
        assert SPECULATORS_FIELDS <= set(raw)
        assert raw["speculators_model_type"] == "eagle3" and raw["architectures"] == ["Eagle3Speculator"]
        assert raw["draft_vocab_size"] == DRAFT_VOCAB and raw["norm_before_residual"] is False
        assert raw["eagle_aux_hidden_state_layer_ids"] == list(head.config.layers)
        spec = raw["speculators_config"]
        assert spec["algorithm"] == "eagle3" and spec["default_proposal_method"] == "greedy"
        assert spec["proposal_methods"] == [{"proposal_type": "greedy", "speculative_tokens": 3}]
        assert set(spec["verifier"]) == {"name_or_path", "architectures"}


@pytest.mark.parametrize("fmt", ["eagle3", "speculators", "ours"])
def test_every_export_loads_back_and_decodes_the_same_tokens(model, tmp_path, fmt):
    head, folder = saved_head(model, tmp_path)
    assert export(folder, "--format", fmt, "--out", tmp_path / "out") == 0
    loaded = load_head(tmp_path / "out", model.config, CPU, torch.float32)
    assert loaded.config.arch == "eagle3" and loaded.config.layers == head.config.layers
    for key, value in head.state_dict().items():
        assert torch.equal(loaded.state_dict()[key], value), key
    prompt = torch.randint(0, model.config.vocab_size, (9,), generator=torch.Generator().manual_seed(1))
    want, _ = decode_all(make_session(model, TREE, head=head), prompt, 24)
    got, stats = decode_all(make_session(model, TREE, head=loaded), prompt, 24)
    assert got == want


def test_an_eagle2_head_exports_only_in_our_format(model, tmp_path, capsys):
    _, folder = saved_head(model, tmp_path, arch="eagle2")
    for fmt in ("eagle3", "speculators"):
        assert export(folder, "--format", fmt, "--out", tmp_path / fmt) == 2
        err = capsys.readouterr().err
        assert "EAGLE-3 heads only" in err and err.count("\n") == 1
        assert not (tmp_path / fmt).exists()
    assert export(folder, "--format", "ours", "--out", tmp_path / "ours") == 0
    assert load_head(tmp_path / "ours", model.config, CPU, torch.float32).config.arch == "eagle2"


def test_a_bad_out_is_refused_with_one_line_unless_forced(model, tmp_path, capsys):
    """--out must be new or empty; --force replaces only a head folder that an export wrote (its .fsd-eagle
    file), never a folder of anything else, the head read, or a folder that holds the head read."""
    _, folder = saved_head(model, tmp_path)
    (tmp_path / "busy").mkdir()
    (tmp_path / "busy" / "keep.txt").write_text("x")
    (tmp_path / "file").write_text("x")
    for out in (tmp_path / "busy", tmp_path / "file", folder):
        assert export(folder, "--format", "eagle3", "--out", out) == 2
        err = capsys.readouterr().err
        assert err.startswith("error: ") and err.count("\n") == 1
    for out, words in ((tmp_path / "busy", "was not written by fsd-eagle"), (folder, "a folder this export reads"),
                       (folder.parent, "an input of this command")):
        before = {p: p.read_bytes() for p in out.rglob("*") if p.is_file()}
        assert export(folder, "--format", "eagle3", "--out", out, "--force") == 2
        err = capsys.readouterr().err
        assert words in err and err.count("\n") == 1, err
        assert {p: p.read_bytes() for p in out.rglob("*") if p.is_file()} == before
    assert export(folder, "--format", "eagle3", "--out", tmp_path / "exported") == 0
    assert sorted(p.name for p in (tmp_path / "exported").iterdir()) == [".fsd-eagle", "config.json",
                                                                         "model.safetensors"]
    assert export(folder, "--format", "speculators", "--out", tmp_path / "exported", "--force") == 0  # ours: replaced
    assert json.loads((tmp_path / "exported" / "config.json").read_text())["speculators_model_type"]
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".")]  # no temporary folder left
    (tmp_path / "empty").mkdir()
    assert export(folder, "--format", "speculators", "--out", tmp_path / "empty") == 0


def test_a_float64_head_exported_as_stored_says_float64(model, tmp_path):
    head, _ = saved_head(model, tmp_path)
    save_head(head.double(), tmp_path / "f64", dtype=torch.float64)
    assert export(tmp_path / "f64", "--format", "eagle3", "--out", tmp_path / "out") == 0
    assert json.loads((tmp_path / "out" / "config.json").read_text())["torch_dtype"] == "float64"


def test_a_published_head_needs_a_target_to_export(model, tmp_path, capsys):
    head, _ = saved_head(model, tmp_path)
    write_head(head, tmp_path / "published", "eagle3", torch.float32)
    assert export(tmp_path / "published", "--format", "speculators", "--out", tmp_path / "out") == 2
    assert "--target" in capsys.readouterr().err
    model.save_pretrained(tmp_path / "target")
    assert export(tmp_path / "published", "--format", "speculators", "--out", tmp_path / "out",
                  "--target", tmp_path / "target", "--dtype", "bfloat16") == 0
    raw = json.loads((tmp_path / "out" / "config.json").read_text())
    assert raw["speculators_config"]["verifier"]["architectures"] == ["LlamaForCausalLM"]
    loaded = load_head(tmp_path / "out", model.config, CPU, torch.float32)
    assert loaded.fc.weight.dtype == torch.float32 and raw["torch_dtype"] == "bfloat16"
    assert torch.equal(loaded.lm_head.weight, head.lm_head.weight.bfloat16().float())


def test_a_failed_write_leaves_nothing(model, tmp_path, monkeypatch):
    head, _ = saved_head(model, tmp_path)
    monkeypatch.setattr("fsd_eagle.export.export_state", lambda *a: (_ for _ in ()).throw(OSError("disk full")))
    with pytest.raises(OSError):
        write_head(head, tmp_path / "out", "speculators", torch.float32)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["head"]
    with pytest.raises(ConfigError):
        write_head(head, tmp_path / "out", "gguf", torch.float32)


def _model_type(raw, state):
    raw["speculators_model_type"] = "eagle"


def _norm_before_residual(raw, state):
    raw["norm_before_residual"] = True


def _two_layers(raw, state):
    state["layers.1.mlp.down_proj.weight"] = state["layers.0.mlp.down_proj.weight"].clone()


def _target_hidden(raw, state):
    raw["target_hidden_size"] = 2 * raw["transformer_layer_config"]["hidden_size"]


def _no_layer_config(raw, state):
    raw["transformer_layer_config"] = None


@pytest.mark.parametrize("case,error", [(_model_type, ModelLoadError), (_norm_before_residual, ModelLoadError),
                                        (_two_layers, ModelLoadError), (_target_hidden, HeadMismatchError),
                                        (_no_layer_config, ModelLoadError)])
def test_a_speculators_head_we_cannot_run_is_refused_with_one_line(model, tmp_path, case, error):
    from safetensors.torch import load_file, save_file

    head, _ = saved_head(model, tmp_path)
    out = write_head(head, tmp_path / "spec", "speculators", torch.float32)
    raw, state = json.loads((out / "config.json").read_text()), load_file(out / "model.safetensors")
    case(raw, state)
    (out / "config.json").write_text(json.dumps(raw))
    save_file(state, out / "model.safetensors")
    with pytest.raises(error) as info:
        load_head(out, model.config, CPU, torch.float32)
    assert "\n" not in str(info.value)

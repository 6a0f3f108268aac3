"""Writing a draft head in the layouts other engines load (``python -m training export HEAD_DIR --format
eagle3|speculators|ours --out DIR``).

- ``eagle3``: the published EAGLE-3 layout (SafeAILab/EAGLE's EAGLE-3 heads, as SGLang and vLLM load them):
  a Llama config.json with ``"architectures": ["LlamaForCausalLMEagle3"]``, ``draft_vocab_size`` and
  ``eagle_config.eagle_aux_hidden_state_layer_ids``; model.safetensors with ``fc.weight``, ``midlayer.*``
  (self_attn q/k/v/o_proj, mlp gate/up/down_proj, input_layernorm, hidden_norm, post_attention_layernorm),
  ``norm.weight``, ``lm_head.weight``, ``d2t`` (int64) and ``t2d`` (bool).
- ``speculators``: vLLM's speculators format for EAGLE-3, as specified in the GitHub repository
  vllm-project/speculators: ``src/speculators/models/eagle3/config.py`` (Eagle3SpeculatorConfig:
  speculators_model_type "eagle3", architectures ["Eagle3Speculator"], transformer_layer_config,
  draft_vocab_size, norm_before_residual, target_hidden_size, eagle_aux_hidden_state_layer_ids),
  ``src/speculators/config.py`` (speculators_version, speculators_config: algorithm, proposal_methods,
  default_proposal_method, verifier {name_or_path, architectures}), ``src/speculators/models/eagle3/core.py``
  (weight names: fc, layers.N, norm, lm_head, d2t, t2d; embed_tokens and the verifier's norm / lm_head are
  not stored) and ``src/speculators/models/eagle3/model_definitions.py`` (the first layer's hidden_norm;
  with norm_before_residual false its residual is the un-normalized hidden state, as in our head). vLLM
  reads it in vllm-project/vllm ``vllm/transformers_utils/configs/speculators/base.py``, which requires
  ``speculators_config.proposal_methods[0].speculative_tokens`` and ``speculators_config.verifier.name_or_path``.
- ``ours``: our own format (``models.save_head``).

Both EAGLE-3 layouts describe EAGLE-3 heads only: an eagle2 head is refused for them. A folder is written
next to its destination and renamed into place, so an interrupted export leaves no half-written head.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import tempfile
from pathlib import Path
from types import SimpleNamespace
from typing import Sequence

import torch

from .errors import ConfigError, FSDError, InputError, ModelLoadError
from .head import EagleHead, HeadConfig
from .models import load_head, save_head
from .outputs import check_replaceable, mark_ours

FORMATS = ("eagle3", "speculators", "ours")
SPECULATORS_VERSION = "0.3.0"  # the speculators release whose layout this writes
DEFAULT_SPECULATIVE_TOKENS = 3
DTYPE_NAMES = {torch.float32: "float32", torch.bfloat16: "bfloat16", torch.float16: "float16",
               torch.float64: "float64"}


def llama_layer_config(cfg: HeadConfig, dtype: torch.dtype) -> dict:
    """The head's decoder layer as a transformers Llama config (one layer, RoPE in the 4.x fields that
    both layouts' readers take: rope_theta, rope_scaling)."""
    rope = dict(cfg.rope_parameters)
    theta = float(rope.pop("rope_theta", 10000.0))
    scaling = rope if rope.get("rope_type", "default") != "default" else None
    return {
        "architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": cfg.hidden_size,
        "intermediate_size": cfg.intermediate_size, "num_attention_heads": cfg.num_attention_heads,
        "num_key_value_heads": cfg.num_key_value_heads, "head_dim": cfg.dim, "hidden_act": cfg.hidden_act,
        "rms_norm_eps": cfg.rms_norm_eps, "attention_bias": cfg.attention_bias, "mlp_bias": False,
        "max_position_embeddings": cfg.max_position_embeddings, "rope_theta": theta, "rope_scaling": scaling,
        "vocab_size": cfg.vocab_size, "num_hidden_layers": 1, "tie_word_embeddings": False,
        "torch_dtype": DTYPE_NAMES.get(dtype, str(dtype).removeprefix("torch.")),
    }


def eagle3_config(cfg: HeadConfig, dtype: torch.dtype) -> dict:
    """config.json of the published EAGLE-3 layout."""
    return llama_layer_config(cfg, dtype) | {
        "architectures": ["LlamaForCausalLMEagle3"], "draft_vocab_size": cfg.draft_vocab_size,
        "eagle_config": {"eagle_aux_hidden_state_layer_ids": list(cfg.layers)},
    }


def speculators_config(cfg: HeadConfig, dtype: torch.dtype, verifier_architectures: list | None = None,
                       speculative_tokens: int = DEFAULT_SPECULATIVE_TOKENS) -> dict:
    """config.json of the speculators format (see the module docstring for its specification)."""
    return {
        "architectures": ["Eagle3Speculator"], "speculators_model_type": "eagle3",
        "speculators_version": SPECULATORS_VERSION, "torch_dtype": DTYPE_NAMES.get(dtype, str(dtype).removeprefix("torch.")),
        "draft_vocab_size": cfg.draft_vocab_size, "norm_before_residual": False,
        "target_hidden_size": None, "eagle_aux_hidden_state_layer_ids": list(cfg.layers),
        "transformer_layer_config": llama_layer_config(cfg, dtype),
        "speculators_config": {
            "algorithm": "eagle3",
            "proposal_methods": [{"proposal_type": "greedy", "speculative_tokens": speculative_tokens}],
            "default_proposal_method": "greedy",
            "verifier": {"name_or_path": cfg.target or None, "architectures": list(verifier_architectures or [])},
        },
    }


def export_state(head: EagleHead, fmt: str, dtype: torch.dtype) -> dict[str, torch.Tensor]:
    """The head's tensors under ``fmt``'s names: floating ones in ``dtype``, d2t int64, t2d bool; the
    speculators format names the decoder layer ``layers.0`` where EAGLE-3 says ``midlayer``."""
    state = {}
    for key, value in head.state_dict().items():
        if fmt == "speculators" and key.startswith("midlayer."):
            key = "layers.0." + key[len("midlayer."):]
        value = value.detach().to("cpu", dtype if value.is_floating_point() else value.dtype)
        state[key] = value.contiguous()
    return state


def check_out(out: Path, force: bool, inputs: Sequence = ()) -> None:
    """``out`` must be new, an empty folder, or (with ``force``) a head folder an export wrote (its MARK),
    holding none of ``inputs`` (the head read, the target): never the head read or a folder around it."""
    if any(i is not None and Path(i).exists() and Path(out).resolve() == Path(i).resolve() for i in inputs):
        raise InputError(f"--out {out} is a folder this export reads; choose another folder")
    if out.exists() and not out.is_dir():
        raise InputError(f"--out {out} exists and is not a folder")
    if out.is_dir() and any(out.iterdir()) and not force:
        raise InputError(f"--out {out} is not empty; pass --force to replace it")
    if force:
        check_replaceable(out, inputs, "--force")


def write_head(head: EagleHead, out: str | Path, fmt: str, dtype: torch.dtype = torch.bfloat16, *,
               force: bool = False, verifier_architectures: list | None = None,
               speculative_tokens: int = DEFAULT_SPECULATIVE_TOKENS) -> Path:
    """Write ``head`` into the folder ``out`` in ``fmt`` (one of FORMATS); the folder appears whole or not
    at all (written beside it, then renamed). Returns ``out``."""
    from safetensors.torch import save_file

    out = Path(out)
    if fmt not in FORMATS:
        raise ConfigError(f"unknown export format {fmt!r}; choose one of {', '.join(FORMATS)}")
    if fmt != "ours" and not head.config.eagle3:
        raise ConfigError(f"the {fmt} format holds EAGLE-3 heads only; this head is {head.config.arch} "
                          "(export it with --format ours)")
    if not isinstance(speculative_tokens, int) or speculative_tokens < 1:
        raise ConfigError(f"speculative tokens must be an integer >= 1, got {speculative_tokens!r}")
    check_out(out, force)
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{out.name}.", suffix=".partial", dir=out.parent))
    umask = os.umask(0)
    os.umask(umask)
    tmp.chmod(0o777 & ~umask)  # mkdtemp makes it private; the head folder gets the usual permissions
    try:
        if fmt == "ours":
            save_head(head, tmp, dtype)
        else:
            config = (eagle3_config(head.config, dtype) if fmt == "eagle3" else
                      speculators_config(head.config, dtype, verifier_architectures, speculative_tokens))
            save_file(export_state(head, fmt, dtype), tmp / "model.safetensors", metadata={"format": "pt"})
            (tmp / "config.json").write_text(json.dumps(config, indent=2) + "\n", encoding="utf-8")
        mark_ours(tmp, f"exported head ({fmt})")
        _replace(tmp, out)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return out


def _replace(tmp: Path, out: Path) -> None:
    """Rename ``tmp`` to ``out``; an existing ``out`` is moved aside first and removed once ``tmp`` is in place."""
    old = None
    if out.exists():
        old = out.with_name(f".{out.name}.{os.getpid()}.old")
        out.rename(old)
    try:
        tmp.rename(out)
    except OSError:
        if old is not None:
            old.rename(out)
        raise
    if old is not None:
        shutil.rmtree(old, ignore_errors=True)


def head_as_target(cfg: HeadConfig) -> SimpleNamespace:
    """A stand-in target config that a head of ``cfg`` fits exactly (for reading a head with no target)."""
    return SimpleNamespace(**{k: v for k, v in cfg.to_dict().items() if k not in ("arch", "layers", "target")},
                           num_hidden_layers=max(cfg.layers, default=0) + 1, _name_or_path=cfg.target,
                           model_type="llama")


def target_config(path: str | Path):
    """A target folder's transformers config (the config only: no weights are read)."""
    from transformers import AutoConfig

    from .models import refuse_custom_code

    folder = Path(path)
    if not (folder / "config.json").exists():
        raise ModelLoadError(f"no model at {folder}: expected a folder with config.json")
    refuse_custom_code(folder)
    try:
        return AutoConfig.from_pretrained(folder, trust_remote_code=False)
    except (OSError, ValueError, KeyError) as e:
        raise ModelLoadError(f"cannot read the model config at {folder}: {' '.join(str(e).split())}") from None


def read_head(folder: str | Path, target=None) -> tuple[EagleHead, torch.dtype]:
    """A head folder as (head, the dtype its weights are stored in). A head in our format describes itself;
    a head in another layout takes what its config leaves out (RoPE, activation) from the ``target``
    config (``target_config``)."""
    from .models import read_weights, read_head_config

    folder = Path(folder)
    cfg_file = folder / "config.json"
    raw = read_head_config(folder)
    fc = read_weights(folder).get("fc.weight")
    dtype = fc.dtype if fc is not None and fc.is_floating_point() else torch.float32
    if target is None and isinstance(raw, dict) and raw.get("format") == "fsd-eagle":
        fields = {k: raw[k] for k in HeadConfig.__dataclass_fields__ if k in raw}
        try:
            target = head_as_target(HeadConfig(**fields))
        except (TypeError, ConfigError) as e:
            raise ModelLoadError(f"bad draft head config {cfg_file}: {e}") from None
    elif target is None:
        raise InputError(f"{folder} is not in our format: give --target (its config supplies RoPE and activation)")
    return load_head(folder, target, torch.device("cpu"), dtype), dtype


def parser() -> argparse.ArgumentParser:
    from .cli import OneLineParser

    p = OneLineParser(prog="python -m training export",
                      description="write a draft head in the layout another engine loads")
    p.add_argument("head", help="head folder (ours, or a published layout with --target)")
    p.add_argument("--format", required=True, choices=FORMATS,
                   help="eagle3: the published EAGLE-3 layout; speculators: vLLM's speculators format; ours")
    p.add_argument("--out", required=True, help="folder to write (must be new or empty, unless --force)")
    p.add_argument("--force", action="store_true", help="replace a non-empty --out")
    p.add_argument("--target", help="target folder (needed for heads not in our format)")
    p.add_argument("--dtype", help="float32, bfloat16 or float16 (default: as stored)")
    p.add_argument("--speculative-tokens", type=int, default=DEFAULT_SPECULATIVE_TOKENS,
                   help="speculators: the draft length recorded for vLLM (default 3)")
    return p


def main(argv: list[str] | None = None) -> int:
    """The ``export`` command; errors are one line on stderr with exit status 2."""
    from .models import DTYPES

    args = parser().parse_args(argv)
    try:
        out, source = Path(args.out), Path(args.head)
        check_out(out, args.force, [source, args.target])
        if args.dtype is not None and args.dtype not in DTYPES:
            raise ConfigError(f"unknown dtype {args.dtype!r}; choose one of float32, bfloat16, float16")
        target = target_config(args.target) if args.target else None
        head, stored = read_head(source, target)
        dtype = DTYPES[args.dtype] if args.dtype else stored
        write_head(head, out, args.format, dtype, force=args.force,
                   verifier_architectures=getattr(target, "architectures", None),
                   speculative_tokens=args.speculative_tokens)
    except FSDError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    print(json.dumps({"head": str(out), "format": args.format, "arch": head.config.arch,
                      "dtype": DTYPE_NAMES.get(dtype, str(dtype))}))
    return 0

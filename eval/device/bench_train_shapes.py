"""What a head-training step costs the first time a batch shape comes, against the same shape again.

A training epoch's batches are length buckets of about ``tokens_per_batch`` tokens, so nearly every batch of
the first epoch has a shape [B, T] not seen before, and later epochs see the same shapes again. On the GPU the
first epoch runs at well under half the speed of the later ones; this measures where that goes: a target of
SmolLM2-135M-Instruct's shape (zero weights: the same kernels and shapes, no download) and the shipped
recipe's EAGLE-3 head take ``--shapes`` batch shapes twice, one timed step each (forward of the target,
the head's unrolled loss, backward, AdamW), under each variant:

- ``default``: torch's choice of kernels, as ``--cudnn-attention on`` trains;
- ``no-cudnn-sdp``: as the trainer runs by default (``--cudnn-attention off``, ``training.train.attention_kernels``):
  every SDPA kernel but cuDNN's, which builds an execution plan per new shape;
- ``target-only``: the target's forward alone (``target_features``), to tell its part from the head's;
- ``compiled``: as ``no-cudnn-sdp`` with ``--compile on`` (``training.train.loss_parts``: the target's forward
  and the loss's logits compiled with dynamic shapes); its first shape waits for the compilation
  (``slowest_first_ms``), later shapes reuse it.

Run it once more with ``PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True`` (set before CUDA starts) and
``--label expandable`` to see the allocator's part.

    python eval/device/bench_train_shapes.py --out $OUT/train_shapes.json [--variants default,no-cudnn-sdp]
"""

import argparse
import dataclasses
import json
import os
import sys
import tempfile
import time
from pathlib import Path

import torch
import transformers

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
from eval.random_models import write_target_folder  # noqa: E402
from fsd_eagle.head import EagleHead  # noqa: E402
from fsd_eagle.jsonl import write_text_atomic  # noqa: E402
from fsd_eagle.models import load_target  # noqa: E402
from fsd_eagle.target import Target  # noqa: E402
from training.cli import head_config  # noqa: E402
from training.recipe import Recipe  # noqa: E402
from training.features import target_features  # noqa: E402
from training.train import attention_kernels, head_loss  # noqa: E402

ROOT = Path(__file__).resolve().parents[2]
VARIANTS = ("default", "no-cudnn-sdp", "target-only", "compiled")


def smollm2_config():
    """SmolLM2-135M-Instruct's architecture (its config.json's shape fields)."""
    from transformers import LlamaConfig

    return LlamaConfig(vocab_size=49152, hidden_size=576, intermediate_size=1536, num_hidden_layers=30,
                       num_attention_heads=9, num_key_value_heads=3, max_position_embeddings=8192,
                       rope_theta=100000.0, rms_norm_eps=1e-5, tie_word_embeddings=True)


def batch_shapes(count: int, tokens: int, max_len: int, seed: int) -> list[tuple[int, int]]:
    """``count`` distinct [B, T] shapes as length buckets make them: T spread over 64..max_len, B = tokens // T."""
    gen = torch.Generator().manual_seed(seed)
    lengths = sorted(set(torch.randint(64, max_len + 1, (4 * count,), generator=gen).tolist()))
    step = max(1, len(lengths) // count)
    return [(max(1, tokens // t), t) for t in lengths[::step][:count]]


def batch(shape: tuple[int, int], vocab: int, device: torch.device, seed: int):
    """Random ids ``[B, T]``, every row a random length (right-padded), loss on the second half of each row."""
    b, t = shape
    gen = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, vocab, (b, t), generator=gen)
    lengths = torch.randint(t // 2, t + 1, (b,), generator=gen)
    lengths[0] = t  # the bucket's longest row sets T
    pos = torch.arange(t)[None]
    attn = pos < lengths[:, None]
    mask = attn & (pos >= lengths[:, None] // 2)
    return ids.to(device), attn.to(device), mask.to(device)


def timed_steps(target: Target, head: EagleHead, opt: torch.optim.Optimizer, recipe: Recipe, shapes: list,
                target_only: bool = False) -> list[float]:
    """Seconds of one training step per shape (synchronised); ``target_only``: the target's forward alone."""
    out = []
    for i, shape in enumerate(shapes):
        ids, attn, mask = batch(shape, target.vocab_size, target.device, i)
        sync(target.device)
        t0 = time.perf_counter()
        if target_only:
            target_features(target, ids, attn, head.config.layers)
            sync(target.device)
            out.append(time.perf_counter() - t0)
            continue
        with torch.autocast(target.device.type, dtype=torch.bfloat16):
            loss, _ = head_loss(head, target, ids, attn, mask, recipe)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
        sync(target.device)
        out.append(time.perf_counter() - t0)
    return out


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize()


def summary(first: list[float], again: list[float]) -> dict:
    return {"first_ms": round(1000 * sum(first) / len(first), 1), "again_ms": round(1000 * sum(again) / len(again), 1),
            "first_over_again": round(sum(first) / sum(again), 2),
            "slowest_first_ms": round(1000 * max(first), 1)}


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", type=Path, required=True)
    p.add_argument("--variants", default=",".join(VARIANTS))
    p.add_argument("--shapes", type=int, default=40)
    p.add_argument("--label", default="", help="a name for this process' settings (e.g. its allocator)")
    p.add_argument("--device", default="cuda", help="cpu: a quick check that it runs (tiny numbers)")
    p.add_argument("--tokens", type=int, help="tokens per batch (default: the recipe's)")
    p.add_argument("--recipe", type=Path, default=ROOT / "training/recipes/smollm2-135m-instruct-eagle3.json")
    args = p.parse_args()
    device = torch.device(args.device)
    recipe = Recipe.load(args.recipe)
    recipe.tokens_per_batch = args.tokens or recipe.tokens_per_batch
    with tempfile.TemporaryDirectory() as scratch:  # the zero-weight folder goes once the model is loaded
        folder = write_target_folder(smollm2_config(), Path(scratch) / "target")
        model, _ = load_target(str(folder), device, torch.bfloat16)
    target = Target(model)
    results = {"device": torch.cuda.get_device_name() if device.type == "cuda" else "cpu", "torch": torch.__version__,
               "transformers": transformers.__version__, "label": args.label,
               "alloc_conf": os.environ.get("PYTORCH_CUDA_ALLOC_CONF", ""), "variants": {}}
    torch.manual_seed(0)  # one step first on a shape no variant runs (T < 64): library and kernel start-up
    head = EagleHead(head_config(recipe, model.config.get_text_config(), "recipe")).to(device)
    timed_steps(target, head, torch.optim.AdamW(head.parameters(), lr=1e-4), recipe, [(8, 63)])
    del head
    for n, variant in enumerate(args.variants.split(",")):
        if variant not in VARIANTS:
            raise SystemExit(f"error: unknown variant {variant!r} (known: {', '.join(VARIANTS)})")
        torch.manual_seed(0)
        head = EagleHead(head_config(recipe, model.config.get_text_config(), "recipe")).to(device)
        head.train()
        opt = torch.optim.AdamW(head.parameters(), lr=1e-4)  # one optimizer: its states allocated once
        # each variant gets shapes no earlier variant ran, so its first pass meets them new
        shapes = batch_shapes(args.shapes, recipe.tokens_per_batch, recipe.max_len, seed=1000 + n)
        run = dataclasses.replace(recipe, cudnn_attention=variant not in ("no-cudnn-sdp", "compiled"),
                                  compile=variant == "compiled")
        with attention_kernels(run):
            first = timed_steps(target, head, opt, run, shapes, variant == "target-only")
            again = timed_steps(target, head, opt, run, shapes, variant == "target-only")
        results["variants"][variant] = {"shapes": len(shapes), **summary(first, again)}
        print(variant, json.dumps(results["variants"][variant]), flush=True)
        del head, opt
        torch.cuda.empty_cache()
        write_text_atomic(args.out, json.dumps(results, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())

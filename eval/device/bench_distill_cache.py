"""What one decoding step of self-distillation costs with transformers' dynamic cache against a static one.

Self-distillation (``training.distill``) answers the training prompts with ``model.generate`` in large
batches (the recipe's ``distill_batch`` rows of up to ``distill_prompt_tokens`` prompt tokens, left-padded).
With the default dynamic cache every step concatenates the new keys and values onto the whole cache; a static
cache writes them in place, and with it ``generate`` compiles the decoding step. This times a step of each on a
randomly initialised model of SmolLM2-135M-Instruct's shape (no download; the cost does not depend on the
weights): two runs of different lengths after a warm-up, the step's cost their difference over the extra steps
(the prefill cancels out). It also reports how many of the greedy answers' tokens agree with the dynamic
cache's (bf16: kernels that differ may round differently).

    python eval/device/bench_distill_cache.py --out $OUT/distill_cache.json [--variants dynamic,static]
"""

import argparse
import json
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
from eval.device.bench_train_shapes import smollm2_config  # noqa: E402
from fsd_eagle.jsonl import write_text_atomic  # noqa: E402
from training.recipe import Recipe  # noqa: E402

ROOT = Path(__file__).resolve().parents[2]
VARIANTS = {  # name: generate's cache settings
    "dynamic": {},
    "static": {"cache_implementation": "static", "disable_compile": True},
    "static-compiled": {"cache_implementation": "static"},
}


def prompts(rows: int, max_len: int, vocab: int, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """Random ids ``[rows, max_len]`` left-padded to lengths spread over max_len/2..max_len, and their mask."""
    gen = torch.Generator().manual_seed(0)
    ids = torch.randint(0, vocab, (rows, max_len), generator=gen)
    lengths = torch.randint(max_len // 2, max_len + 1, (rows,), generator=gen)
    attn = torch.arange(max_len)[None] >= (max_len - lengths)[:, None]
    return (ids * attn).to(device), attn.long().to(device)


def timed_generate(model, ids, attn, new_tokens: int, settings: dict) -> tuple[float, torch.Tensor]:
    """Seconds of one greedy ``generate`` of ``new_tokens`` tokens (synchronised), and its new tokens."""
    sync(ids.device)
    t0 = time.perf_counter()
    out = model.generate(input_ids=ids, attention_mask=attn, max_new_tokens=new_tokens, min_new_tokens=new_tokens,
                         do_sample=False, pad_token_id=0, **settings)
    sync(ids.device)
    return time.perf_counter() - t0, out[:, ids.shape[1]:]


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize()


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", type=Path, required=True)
    p.add_argument("--variants", default=",".join(VARIANTS))
    p.add_argument("--rows", type=int, help="prompts answered at once (default: the recipe's distill_batch)")
    p.add_argument("--short", type=int, default=32, help="new tokens of the shorter timed run")
    p.add_argument("--long", type=int, default=160, help="new tokens of the longer timed run")
    p.add_argument("--recipe", type=Path, default=ROOT / "training/recipes/smollm2-135m-instruct-eagle3.json")
    p.add_argument("--device", default="cuda", help="cpu: a quick check that it runs (tiny numbers)")
    args = p.parse_args()
    import transformers
    from transformers import AutoModelForCausalLM

    recipe = Recipe.load(args.recipe)
    rows = args.rows or recipe.distill_batch
    device = torch.device(args.device)
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(smollm2_config(), dtype=torch.bfloat16, trust_remote_code=False)
    model = model.to(device).eval()
    ids, attn = prompts(rows, recipe.distill_prompt_tokens, model.config.vocab_size, device)
    results = {"device": torch.cuda.get_device_name() if device.type == "cuda" else "cpu",
               "torch": torch.__version__, "transformers": transformers.__version__, "rows": rows,
               "prompt_tokens": recipe.distill_prompt_tokens, "short": args.short, "long": args.long, "variants": {}}
    reference = None
    for variant in args.variants.split(","):
        if variant not in VARIANTS:
            raise SystemExit(f"error: unknown variant {variant!r} (known: {', '.join(VARIANTS)})")
        settings = VARIANTS[variant]
        warm, _ = timed_generate(model, ids, attn, args.short, settings)  # start-up (and compilation) once
        short, _ = timed_generate(model, ids, attn, args.short, settings)
        long, tokens = timed_generate(model, ids, attn, args.long, settings)
        if reference is None:
            reference = tokens
        row = {"warm_up_s": round(warm, 1), "short_s": round(short, 2), "long_s": round(long, 2),
               "step_ms": round(1000 * (long - short) / (args.long - args.short), 2),
               "agree_with_first": round(float((tokens == reference).float().mean()), 4)}
        results["variants"][variant] = row
        print(variant, json.dumps(row), flush=True)
        write_text_atomic(args.out, json.dumps(results, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())

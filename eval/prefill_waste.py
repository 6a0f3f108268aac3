"""Padded prefill tokens of the batch benchmark (eval/batch.py), counted on the CPU without a GPU.

    python -m eval.prefill_waste                                  # batch sizes 1,4,8,16,32,64, 480 prompts
    python -m eval.prefill_waste --batch-sizes 8,32 --lengths lengths.json --out waste.json

The library's own Scheduler and Session decode the benchmark's prompts (their real chat-templated lengths,
random token ids) on a tiny random model, each prompt with a token limit drawn once from a fixed distribution
(``token_limits``: most answers run to the limit of 256, the others end between 50 and 255 tokens, about 100k
new tokens for 480 prompts as the GPU benchmark measured). ``--drafter none`` decodes autoregressively (one
token per round, as the AR baseline: prompts that start together with the same limit end together);
``--drafter noisy`` speculates with a noisy copy of the tiny model as draft model (about 3 tokens per round,
varying from round to round, as EAGLE-2's rounds do). So rows free up and are refilled as in a real run, and
every prefill the Session makes is counted as a CUDA-graph Session would run it: the rows of the PrefillRows it uses times the padded length
(``decode.prefill_bucket`` of its longest prompt), against the prompts' own tokens. The distinct (rows,
padded length) pairs are the prefill graphs a GPU Session of that batch size captures.

Prompt lengths come from ``SpeculativeGenerator.load()`` (the default model's tokenizer) or ``--lengths``
(a JSON list); ``--save-lengths`` writes them for later runs.
"""

from __future__ import annotations

import argparse
import copy
import json
import random
from dataclasses import dataclass, field
from pathlib import Path

import torch

from fsd_eagle.config import TreeConfig
from fsd_eagle.decode import prefill_bucket
from fsd_eagle.engine import Engine
from fsd_eagle.jsonl import write_text_atomic
from fsd_eagle.schedule import Request, Scheduler
from fsd_eagle.session import Plan, Session, session_rows
from fsd_eagle.verify import AcceptanceRule

DEFAULT_BATCH_SIZES = "1,4,8,16,32,64"


def token_limits(n: int, seed: int = 0, cap: int = 256, full: float = 0.55, low: int = 50) -> list[int]:
    """``n`` token limits: ``cap`` with probability ``full`` (answers cut at the limit), else uniform in
    [low, cap) (answers that end earlier); the mean is about 209 for the defaults."""
    rng = random.Random(seed)
    return [cap if rng.random() < full else rng.randrange(low, cap) for _ in range(n)]


def benchmark_lengths(limit: int | None = None) -> list[int]:
    """Token counts of the batch benchmark's prompts, chat template applied, as ``generate`` encodes them."""
    from fsd_eagle import SpeculativeGenerator

    from .batch import load_prompts

    gen = SpeculativeGenerator.load(device="cpu", dtype="float32")
    return [len(gen.encode(p)) for p in load_prompts(limit)]


VOCAB = 64
DRAFT_TREE = TreeConfig(total_tokens=12, depth=4, top_k=3)


def tiny_engine(max_positions: int, drafter: str = "none") -> Engine:
    """A one-layer random Llama of width 16 (rounds cost little, prompts of any benchmark length fit); with
    ``drafter`` "noisy", a copy of it with Gaussian noise of 0.1 standard deviations on its matrices drafts."""
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(vocab_size=VOCAB, hidden_size=16, intermediate_size=32, num_hidden_layers=1,
                         num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=max_positions)
    gen = torch.Generator().manual_seed(0)
    with torch.random.fork_rng():
        torch.manual_seed(0)
        model = LlamaForCausalLM(config).float().eval()
    if drafter == "none":
        return Engine(model, None)
    draft = copy.deepcopy(model)
    with torch.no_grad():
        for param in draft.parameters():
            if param.dim() > 1:
                param.add_(0.1 * param.std() * torch.randn(param.shape, generator=gen))
    return Engine(model, None, draft_model=draft)


@dataclass
class Prefill:
    """One prefill forward as a graph Session runs it: ``rows`` x ``padded`` positions for ``lengths``."""

    rows: int
    padded: int
    lengths: list[int]


class CountingSession(Session):
    """A Session that records each prefill's rows, padded length and prompt lengths."""

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.counted: list[Prefill] = []

    def _prefill(self, pre, prompts):
        lengths = [int(p.shape[0]) for p in prompts]
        self.counted.append(Prefill(pre.rows, prefill_bucket(max(lengths)), lengths))
        return super()._prefill(pre, prompts)


@dataclass
class Waste:
    """What one batch size's prefills processed."""

    batch_size: int
    prefills: int
    real_tokens: int
    padded_tokens: int
    graphs: int
    shapes: list[tuple[int, int]] = field(default_factory=list)

    @property
    def ratio(self) -> float:
        return self.padded_tokens / self.real_tokens

    def to_dict(self) -> dict:
        return {"batch_size": self.batch_size, "prefills": self.prefills, "real_tokens": self.real_tokens,
                "padded_tokens": self.padded_tokens, "ratio": round(self.ratio, 3), "graphs": self.graphs,
                "shapes": [list(s) for s in self.shapes]}


def summarize(batch_size: int, prefills: list[Prefill]) -> Waste:
    shapes = sorted({(p.rows, p.padded) for p in prefills})
    return Waste(batch_size, len(prefills), sum(sum(p.lengths) for p in prefills),
                 sum(p.rows * p.padded for p in prefills), len(shapes), shapes)


def measure(lengths: list[int], limits: list[int], batch_size: int, drafter: str = "none") -> list[Prefill]:
    """Decode random prompts of ``lengths`` tokens with token limits ``limits`` on ``batch_size`` rows (with
    ``drafter``, see ``tiny_engine``); the prefills."""
    engine = tiny_engine(max(lengths) + max(limits) + 64, drafter)
    rule = AcceptanceRule()
    plan = Plan(DRAFT_TREE, rule.form, drafting=drafter != "none", batch=session_rows(batch_size))
    session = CountingSession(engine, plan)
    gen = torch.Generator().manual_seed(1)
    requests = [Request(torch.randint(0, VOCAB, (n,), generator=gen), m, rule) for n, m in zip(lengths, limits)]
    for _ in Scheduler(session, requests, batch_size).run():
        pass
    return session.counted


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(prog="python -m eval.prefill_waste", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--batch-sizes", default=DEFAULT_BATCH_SIZES)
    p.add_argument("--limit", type=int, help="the benchmark's first N prompts (default all 480)")
    p.add_argument("--lengths", help="a JSON list of prompt lengths instead of the benchmark's")
    p.add_argument("--save-lengths", help="write the prompt lengths used to this JSON file")
    p.add_argument("--seed", type=int, default=0, help="seed of the token limits")
    p.add_argument("--drafter", choices=("none", "noisy"), default="none",
                   help="none: autoregressive rounds; noisy: speculative rounds with a noisy draft model")
    p.add_argument("--threads", type=int, default=1,
                   help="torch CPU threads (default 1: the tiny model's matmuls only lose to thread start-up)")
    p.add_argument("--out", help="write the counts and every prefill (rows, padded, lengths) to this JSON file")
    args = p.parse_args(argv)
    torch.set_num_threads(args.threads)
    lengths = json.loads(Path(args.lengths).read_text()) if args.lengths else benchmark_lengths(args.limit)
    lengths = lengths[: args.limit] if args.limit else lengths
    if args.save_lengths:
        write_text_atomic(args.save_lengths, json.dumps(lengths))
    limits = token_limits(len(lengths), args.seed)
    print(f"{len(lengths)} prompts, {sum(lengths)} prompt tokens, {sum(limits)} new tokens at most")
    print(f"{'batch':>5} {'prefills':>8} {'real':>8} {'padded':>9} {'ratio':>6} {'graphs':>6}")
    out = {"prompts": len(lengths), "prompt_tokens": sum(lengths), "new_tokens": sum(limits),
           "drafter": args.drafter, "rows": []}
    for b in (int(x) for x in args.batch_sizes.split(",")):
        prefills = measure(lengths, limits, b, args.drafter)
        w = summarize(b, prefills)
        print(f"{b:>5} {w.prefills:>8} {w.real_tokens:>8} {w.padded_tokens:>9} {w.ratio:>6.2f} {w.graphs:>6}",
              flush=True)
        out["rows"].append({**w.to_dict(), "prefill_calls": [[q.rows, q.padded, q.lengths] for q in prefills]})
    if args.out:
        write_text_atomic(args.out, json.dumps(out))


if __name__ == "__main__":
    main()

"""The ``fsd-eagle`` command line: ``generate`` (and, from a checkout, ``train`` and ``bench``).

torch and transformers are imported inside ``main``'s handlers, so that bad input, and a Ctrl-C at any
moment (while they load, too), end with one line on stderr: exit status 2 for an error, 130 when
interrupted."""

from __future__ import annotations

import argparse
import json
import os
import runpy
import sys

from .errors import FSDError, InputError

SEED_RANGE = (-(2**63), 2**64 - 1)  # what torch.Generator.manual_seed takes


class OneLineParser(argparse.ArgumentParser):
    """argparse whose usage errors are one line on stderr (not a usage block), with exit status 2."""

    def error(self, message: str):
        self.exit(2, f"error: {self.prog}: {' '.join(message.split())} (see --help)\n")


def _generate_parser(sub) -> None:
    from .attention import BACKENDS
    from .divergence import DIVERGENCES

    p = sub.add_parser("generate", help="generate text with speculative decoding")
    p.add_argument("prompt", help="the user message (the chat template is applied when the model has one)")
    p.add_argument("--target", help="local transformers model folder (default: SmolLM2-135M-Instruct)")
    p.add_argument("--head", help="draft head folder (default: the shipped head of the default target)")
    p.add_argument("--draft-model", help="a small causal LM folder to draft with instead of a head")
    p.add_argument("--max-new-tokens", type=int, default=256)
    p.add_argument("--temperature", type=float, default=0.0, help="0 = greedy")
    p.add_argument("--top-p", type=float, default=1.0)
    p.add_argument("--top-k", type=int, default=0)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--stop", action="append", default=[], help="stop string (repeatable)")
    p.add_argument("--total-tokens", type=int, default=None, help="tree nodes per round, root included")
    p.add_argument("--depth", type=int, default=None, help="tree depth (draft tokens on the longest path)")
    p.add_argument("--tree-top-k", type=int, default=None, help="children per expanded node (1 = chain)")
    p.add_argument("--draft-vocab", type=int, default=None,
                   help="draft among the head's N most frequent tokens (0 = all; default: the preset's)")
    p.add_argument("--threshold", default="0", help="FSD threshold T (a number >= 0 or 'inf'); 0 = exact")
    p.add_argument("--divergence", default="kl", help=f"one of {', '.join(DIVERGENCES)}")
    p.add_argument("--fuzzy-mode", default="hybrid", help="hybrid (default) or pure")
    p.add_argument("--support-top-k", type=int, default=0, help="truncate D's support to top-k of p + rest")
    p.add_argument("--autoregressive", action="store_true", help="plain decoding of the target (baseline)")
    p.add_argument("--no-chat", action="store_true", help="use the prompt as raw text, no chat template")
    p.add_argument("--device", default=None, help="cpu, cuda or cuda:N (default: cuda if available)")
    p.add_argument("--dtype", default=None, help="float32, bfloat16 or float16 (default: bf16 on GPU, fp32 on CPU)")
    p.add_argument("--threads", type=int, default=None,
                   help="torch CPU threads (default on the CPU: cores - 1, at most 4, at least 1; unless "
                        "OMP_NUM_THREADS is set)")
    p.add_argument("--compile", action="store_true",
                   help="GPU: torch.compile the round before graph capture (slow first call, faster rounds)")
    p.add_argument("--attention", choices=BACKENDS, default=None,
                   help="tree attention of rounds (default: flex for compiled GPU rounds, where it pays off; "
                        "else sdpa)")
    p.add_argument("--json", action="store_true", help="print one JSON object instead of streaming text")


def run_generate(args: argparse.Namespace) -> int:
    from .api import SpeculativeGenerator
    from .config import FuzzyConfig, SamplingConfig, parse_threshold

    # Everything that can be checked without the model is checked before it loads.
    fuzzy = FuzzyConfig(threshold=parse_threshold(args.threshold), divergence=args.divergence,
                        mode=args.fuzzy_mode, support_top_k=args.support_top_k)
    SamplingConfig(temperature=args.temperature, top_p=args.top_p, top_k=args.top_k)
    if not SEED_RANGE[0] <= args.seed <= SEED_RANGE[1]:
        raise InputError(f"--seed must be an integer from -2**63 to 2**64 - 1, got {args.seed}")
    if args.max_new_tokens < 1:
        raise InputError(f"--max-new-tokens must be at least 1, got {args.max_new_tokens}")
    quiet_transformers()
    gen = SpeculativeGenerator.load(target=args.target, head=args.head, draft_model=args.draft_model,
                                    device=args.device, dtype=args.dtype, compile=args.compile, threads=args.threads)
    # the preset, with explicit values winning
    gen.set_tree(args.total_tokens, args.depth, args.tree_top_k, args.draft_vocab)
    gen.use_attention(args.attention)
    kwargs = dict(max_new_tokens=args.max_new_tokens, temperature=args.temperature, top_p=args.top_p,
                  top_k=args.top_k, fuzzy=fuzzy, seed=args.seed, stop=args.stop, chat=False if args.no_chat else None,
                  autoregressive=args.autoregressive)
    if args.json:
        result = gen.generate(args.prompt, **kwargs)
        print(json.dumps(result.to_dict(), ensure_ascii=False))
        return 0
    for piece in gen.stream(args.prompt, **kwargs, with_result=True):
        if isinstance(piece, str):
            print(piece, end="", flush=True)
        else:
            print()
            print(stats_line(piece.stats), file=sys.stderr)
    return 0


def stats_line(stats) -> str:
    """One line of statistics for stderr after streamed text (stdout keeps the text alone)."""
    fuzzy = f", {stats.fuzzy_accepted} fuzzy-accepted" if stats.fuzzy_accepted else ""
    return (f"[{stats.new_tokens} tokens in {stats.elapsed_s:.2f} s: {stats.tokens_per_s:.1f} tokens/s, "
            f"tau {stats.tau:.2f} ({stats.target_forwards} target forwards){fuzzy}]")


def quiet_transformers() -> None:
    """No loading progress bars or info logs from transformers: stderr is for our one-line errors."""
    from transformers.utils import logging as hf_logging

    hf_logging.set_verbosity_error()
    hf_logging.disable_progress_bar()


def _checkout_module(name: str, argv: list[str]) -> int:
    """Run ``python -m <name>`` from the source checkout (training/ and eval/ are not installed)."""
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    if not os.path.isdir(os.path.join(root, name)):
        raise FSDError(f"'fsd-eagle {name}' needs a source checkout of fsd-eagle (no {name}/ next to the package)")
    sys.path.insert(0, root)
    sys.argv = [f"fsd-eagle {name}"] + argv
    runpy.run_module(name, run_name="__main__")
    return 0


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    try:
        if argv and argv[0] in ("train", "bench"):
            return _checkout_module({"train": "training", "bench": "eval"}[argv[0]], argv[1:])
        return run_generate(_parser().parse_args(argv))
    except FSDError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("interrupted", file=sys.stderr)
        return 130
    except BrokenPipeError:  # the reader of stdout went away (e.g. `| head`): stop quietly
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 1


def _parser() -> argparse.ArgumentParser:
    parser = OneLineParser(prog="fsd-eagle", description="EAGLE-2 + Fuzzy Speculative Decoding")
    sub = parser.add_subparsers(dest="command", required=True)
    _generate_parser(sub)
    sub.add_parser("train", help="train a draft head (runs training/ from a checkout)", add_help=False)
    sub.add_parser("bench", help="run benchmarks (runs eval/ from a checkout)", add_help=False)
    return parser


def exit_with(code: int):
    """Leave the process with ``code``. After a Ctrl-C (130) the process leaves at once, stdio flushed:
    CPython 3.11 otherwise ends it by SIGINT instead of the status when the interrupt struck code run by
    exec() (e.g. while an import creates dataclasses), even though the interrupt was handled."""
    if code == 130:
        for stream in (sys.stdout, sys.stderr):
            try:
                stream.flush()
            except (OSError, ValueError):
                pass
        os._exit(130)
    sys.exit(code)


def script() -> None:
    """The ``fsd-eagle`` executable."""
    exit_with(main())


if __name__ == "__main__":
    script()

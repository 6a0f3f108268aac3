"""The ``fsd-eagle`` command line: ``generate`` (and, from a checkout, ``train`` and ``bench``).

``generate`` takes one prompt, or a JSON-lines file of them (``--input``), whose results are appended to a
JSON-lines file (``--output``) as each prompt finishes, so that an interrupted run resumes where it stopped.

torch and transformers are imported inside ``main``'s handlers, so that bad input, and a Ctrl-C at any
moment (while they load, too), end with one line on stderr: exit status 2 for an error, 130 when
interrupted."""

from __future__ import annotations

import argparse
import json
import os
import re
import runpy
import sys
import time
from dataclasses import dataclass
from pathlib import Path

from .config import CHILDREN, check_seed
from .errors import FSDError, InputError, exit_out_of_memory
from .jsonl import json_type, parse_object

BATCH_SIZE = 16  # --input: prompts decoded together by default
CPU_CONTEXT = 2048  # serve on the CPU: tokens of context per request by default (caches of every row hold it)
PROGRESS_EVERY_S = 30.0  # --input, stderr not a terminal: seconds between progress lines
INPUT_FIELDS = ("id", "prompt", "messages", "seed")
# Settings a line might try to set for itself: refused, rather than silently ignored (other fields are
# ignored, so that data sets with answers or metadata can be used as they are).
LINE_SETTINGS = ("max_new_tokens", "temperature", "top_p", "top_k", "stop", "threshold", "divergence", "fuzzy",
                 "fuzzy_mode", "support_top_k", "chat", "autoregressive", "batch_size", "children")


class OneLineParser(argparse.ArgumentParser):
    """argparse whose usage errors are one line on stderr (not a usage block), with exit status 2."""

    def error(self, message: str):
        self.exit(2, f"error: {self.prog}: {' '.join(message.split())} (see --help)\n")


def _generate_parser(sub) -> None:
    from .divergence import DIVERGENCES

    p = sub.add_parser("generate", help="generate text with speculative decoding")
    p.add_argument("prompt", nargs="?", default=None,
                   help="the user message (the chat template is applied when the model has one); or --input")
    p.add_argument("--input", metavar="FILE",
                   help="JSON-lines file of prompts ('-' = stdin): one object a line with \"prompt\" (text) or "
                        "\"messages\" (chat), optional \"id\" (default: the line number) and \"seed\"")
    p.add_argument("--output", metavar="FILE",
                   help="with --input: JSON-lines results, appended as each prompt finishes (completion order); "
                        "results already in the file are skipped, so rerunning resumes; a file of another input, "
                        "settings or model is refused (default or '-': stdout)")
    p.add_argument("--batch-size", type=int, default=None,
                   help=f"with --input: prompts decoded together (default {BATCH_SIZE})")
    p.add_argument("--overwrite", action="store_true",
                   help="with --output: start afresh an output file of another run (only one that this command "
                        "wrote: other files are never touched)")
    p.add_argument("--quiet", action="store_true", help="no progress or statistics on stderr")
    _model_options(p)
    p.add_argument("--max-new-tokens", type=int, default=256)
    p.add_argument("--temperature", type=float, default=0.0, help="0 = greedy")
    p.add_argument("--top-p", type=float, default=1.0)
    p.add_argument("--top-k", type=int, default=0)
    p.add_argument("--children", choices=CHILDREN, default="auto",
                   help="sampling: draft each node's most likely tokens (top) or draw them from the drafter at "
                        "the temperature (sampled: speculative sampling; more accepted with a chain); auto: "
                        "sampled where the tree draws children from a pool, else top")
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
    p.add_argument("--no-chat", action="store_true",
                   help="use the prompt as raw text, no chat template (--input: \"prompt\" lines)")
    p.add_argument("--json", action="store_true", help="print one JSON object instead of streaming text")
    p.add_argument("--tp-size", type=int, default=None,
                   help="shard the target over N GPUs (tensor parallelism): starts N processes on this machine, "
                        "or under torchrun --nproc-per-node N (which sets the default) joins its launch; rank 0 "
                        "prints")


def _model_options(p) -> None:
    """The options that choose the model, its drafter and how it runs: ``generate``'s and ``serve``'s."""
    from .attention import BACKENDS

    p.add_argument("--target", help="local transformers model folder (default: SmolLM2-135M-Instruct)")
    p.add_argument("--head", help="draft head folder (default: the head shipped for the target, if any)")
    p.add_argument("--draft-model", help="a small causal LM folder to draft with instead of a head")
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


def _serve_parser(sub) -> None:
    p = sub.add_parser("serve", help="serve the model over an OpenAI-compatible HTTP API")
    _model_options(p)
    p.add_argument("--host", default="127.0.0.1", help="address to listen on (default 127.0.0.1)")
    p.add_argument("--port", type=int, default=8000, help="port to listen on (default 8000)")
    p.add_argument("--max-batch", type=int, default=8,
                   help="requests of one rule form decoded together (default 8; rounded up to a batch bucket)")
    p.add_argument("--max-queue", type=int, default=256,
                   help="requests that may wait for a row; more are answered 429 (default 256)")
    p.add_argument("--max-model-len", type=int, default=None,
                   help="tokens of context per request, prompt and completion (default: the model's on a GPU, "
                        "at most 2048 on the CPU)")
    p.add_argument("--api-key", default=os.environ.get("FSD_EAGLE_API_KEY"),
                   help="require 'Authorization: Bearer KEY' (default: $FSD_EAGLE_API_KEY; none: open)")
    p.add_argument("--served-model-name", default=None, help="the model's name in the API (default: its folder's)")
    p.add_argument("--drain-timeout", type=float, default=30.0,
                   help="seconds SIGTERM lets running requests finish (default 30)")
    p.add_argument("--no-compile", action="store_true",
                   help="GPU: decode on CUDA-graph rounds only (by default the server answers on them from the "
                        "start and compiles rounds in the background, moving each configuration to them once ready)")
    p.add_argument("--quiet", action="store_true", help="no start-up line on stderr")


def run_serve(args: argparse.Namespace) -> int:
    """``serve``: check the options, load the model, serve until SIGTERM (exit 0) or Ctrl-C (130)."""
    try:
        from .server.app import check_address, serve
        from .server.serving import Settings
    except ImportError as e:
        raise FSDError(f"serve needs FastAPI, uvicorn and prometheus-client: pip install 'fsd-eagle[serve]' ({e.name} "
                       "is missing)") from None
    from .trees_presets import model_name

    for name in ("max_batch", "max_queue"):
        if getattr(args, name) < 1:
            raise InputError(f"--{name.replace('_', '-')} must be at least 1, got {getattr(args, name)}")
    if args.max_model_len is not None and args.max_model_len < 2:
        raise InputError(f"--max-model-len must be at least 2, got {args.max_model_len}")
    if not args.drain_timeout >= 0:
        raise InputError(f"--drain-timeout must be a number of seconds >= 0, got {args.drain_timeout}")
    if args.api_key is not None and not args.api_key.strip():
        raise InputError("--api-key is empty")
    check_address(args.host, args.port)
    args.tp_size, args.autoregressive, args.json = 1, False, False
    args.total_tokens = args.depth = args.tree_top_k = args.draft_vocab = None
    background = not args.no_compile  # compiled sessions are made beside serving, not at load (``--compile``)
    args.compile = False
    gen = load_generator(args)
    background = background and gen.target.device.type == "cuda" and gen.cuda_graphs
    if background:
        keep_compiled_kernels()
    limit = gen.target.max_positions
    cap = limit if gen.target.device.type == "cuda" else min(limit, CPU_CONTEXT)
    context = min(args.max_model_len or cap, limit)
    name = args.served_model_name or model_name(gen.engine.model.config) or "fsd-eagle"
    options = None  # what loads the same generator in the process that compiles beside the server
    if background:
        options = {"target": args.target, "head": args.head, "draft_model": args.draft_model,
                   "device": str(gen.target.device), "dtype": str(gen.target.dtype).removeprefix("torch."),
                   "threads": args.threads, "attention": args.attention}
    return serve(gen, Settings(name, context), args.host, args.port, args.max_batch, args.max_queue, args.api_key,
                 args.drain_timeout, args.quiet, compile_options=options)


def run_generate(args: argparse.Namespace) -> int:
    from .config import FuzzyConfig, SamplingConfig, parse_threshold

    # Everything that can be checked without the model is checked before it loads.
    if (args.prompt is None) == (args.input is None):
        raise InputError("give one prompt, or --input FILE for a JSON-lines file of prompts" if args.prompt is None
                         else "give one prompt or --input FILE, not both")
    if args.input is None and (args.output is not None or args.batch_size is not None or args.overwrite):
        flag = "--output" if args.output is not None else "--batch-size" if args.batch_size is not None else "--overwrite"
        raise InputError(f"{flag} applies to --input")
    if args.input is not None and args.json:
        raise InputError("--json applies to one prompt (with --input every output line is a JSON object)")
    fuzzy = FuzzyConfig(threshold=parse_threshold(args.threshold), divergence=args.divergence,
                        mode=args.fuzzy_mode, support_top_k=args.support_top_k)
    SamplingConfig(temperature=args.temperature, top_p=args.top_p, top_k=args.top_k, children=args.children)
    check_seed(args.seed, "--seed")
    if args.max_new_tokens < 1:
        raise InputError(f"--max-new-tokens must be at least 1, got {args.max_new_tokens}")
    kwargs = dict(max_new_tokens=args.max_new_tokens, temperature=args.temperature, top_p=args.top_p,
                  top_k=args.top_k, fuzzy=fuzzy, seed=args.seed, stop=args.stop, chat=False if args.no_chat else None,
                  autoregressive=args.autoregressive, children=args.children)
    launched = start_ranks(args)
    if launched is not None:  # the ranks ran as processes of their own
        return launched
    if args.input is not None:
        return run_batch(args, kwargs)
    gen = load_generator(args)
    if args.json:
        result = gen.generate(args.prompt, **kwargs)
        print(json.dumps(result.to_dict(), ensure_ascii=False))
        return 0
    for piece in gen.stream(args.prompt, **kwargs, with_result=True):
        if isinstance(piece, str):
            print(piece, end="", flush=True)
        else:
            print()
            if not args.quiet:
                print(stats_line(piece.stats), file=sys.stderr)
    return 0


def start_ranks(args: argparse.Namespace) -> int | None:
    """Under torchrun (or with --tp-size N > 1): check that the launch has --tp-size processes, join its
    process group, and leave the printing to rank 0 (the other ranks run the same rounds, quietly). Outside
    torchrun, --tp-size N first checks that N divides the target's heads and vocabulary, then starts the N
    processes itself (``parallel.run_ranks``) and returns the launch's exit status (None: decode here)."""
    from . import parallel

    world = parallel.launched_world()
    if args.tp_size is None:
        args.tp_size = world or 1
    parallel.check_tp_size(args.tp_size)
    if world is not None and world > 1 and args.tp_size != world:
        raise InputError(f"this launch has {world} processes but --tp-size is {args.tp_size}: they must be equal")
    if args.tp_size == 1:
        return None
    if args.input == "-":
        raise InputError("with --tp-size > 1, --input must be a file (every rank reads it), not stdin")
    if world is None:
        from .models import read_target_config

        parallel.check_divides(read_target_config(args.target)[1], args.tp_size)
        return parallel.run_ranks([sys.executable, "-m", "fsd_eagle.cli", *args.argv], args.tp_size)
    tp = parallel.start(args.tp_size, args.device)
    if not tp.is_main:
        args.quiet = True
        sys.stdout = open(os.devnull, "w")


def keep_compiled_kernels() -> None:
    """Compiled kernels go to the fsd-eagle cache folder (fsd_eagle.compile_cache.use_folder)."""
    from .compile_cache import use_folder
    from .models import cache_dir

    use_folder(cache_dir() / "compile")


def load_generator(args: argparse.Namespace):
    """The generator the options describe: model, drafter, tree (the preset, explicit values winning), attention."""
    from .api import SpeculativeGenerator
    from .trees_presets import model_name

    quiet_transformers()
    if args.compile:
        keep_compiled_kernels()
    gen = SpeculativeGenerator.load(target=args.target, head=args.head, draft_model=args.draft_model,
                                    device=args.device, dtype=args.dtype, compile=args.compile, threads=args.threads,
                                    tp_size=getattr(args, "tp_size", None) or 1)
    gen.set_tree(args.total_tokens, args.depth, args.tree_top_k, args.draft_vocab)
    gen.use_attention(args.attention)
    if not (gen.engine.has_drafter or args.autoregressive or args.quiet or args.json):
        print(f"note: no draft head is shipped for {model_name(gen.engine.model.config)}: decoding autoregressively "
              "(--head or --draft-model to speculate)", file=sys.stderr)
    return gen


# ------------------------------------------------------------------------------------ --input files


@dataclass
class PromptLine:
    """One prompt of an --input file: its line number (1-based, blank lines counted), id, prompt (text or
    chat messages) and seed (None: --seed)."""

    line: int
    id: str | int
    prompt: str | list[dict]
    seed: int | None = None


def read_prompt_lines(source: str) -> list[PromptLine]:
    """Every prompt of a JSON-lines file (plain or gzip) or of stdin (``-``), checked before any model loads:
    InputError ``input line N: ...`` for the first line that is not usable, or for an id seen before."""
    from .jsonl import id_key, open_binary

    if source == "-":
        lines = list(sys.stdin.buffer)
    else:
        with open_binary(Path(source), "input") as f:
            try:
                lines = list(f)
            except (OSError, EOFError) as e:  # a damaged gzip file
                raise InputError(f"cannot read input file {source}: {e}") from None
    rows: list[PromptLine] = []
    first_line: dict[str, int] = {}
    for number, raw in enumerate(lines, 1):
        try:
            text = raw.decode("utf-8")
        except UnicodeDecodeError as e:
            raise InputError(f"input line {number}: not UTF-8 text (byte {e.start})") from None
        if not text.strip():
            continue
        try:
            row = _prompt_line(number, text)
        except InputError as e:
            raise InputError(f"input line {number}: {e}") from None
        key = id_key(row.id)
        if key in first_line:
            raise InputError(f"input line {number}: duplicate id {key} (first on line {first_line[key]})")
        first_line[key] = number
        rows.append(row)
    if not rows:
        raise InputError(f"the input has no prompts ({'stdin' if source == '-' else source})")
    return rows


def _prompt_line(number: int, text: str) -> PromptLine:
    obj = parse_object(text)
    settings = [k for k in LINE_SETTINGS if k in obj]
    if settings:
        raise InputError(f"\"{settings[0]}\" cannot be set per line (generation settings are the command's "
                         f"options; a line has {', '.join(INPUT_FIELDS)})")
    if ("prompt" in obj) == ("messages" in obj):
        raise InputError("needs a \"prompt\" (text) or \"messages\" (a chat), not both" if "prompt" in obj
                         else "needs a \"prompt\" (text) or \"messages\" (a chat)")
    if "prompt" in obj:
        prompt = obj["prompt"]
        if not isinstance(prompt, str):
            raise InputError(f"\"prompt\" must be a string, got {json_type(prompt)}")
        if not prompt.strip():
            raise InputError("the prompt is empty")
        _check_utf8(prompt, "the prompt")
    else:
        prompt = obj["messages"]
        if not isinstance(prompt, list) or not prompt:
            raise InputError("\"messages\" must be a non-empty list of {\"role\": ..., \"content\": ...} objects")
        for i, m in enumerate(prompt):
            if not isinstance(m, dict) or not isinstance(m.get("role"), str) or not isinstance(m.get("content"), str):
                raise InputError(f"message {i} needs a \"role\" and a \"content\", both strings")
            _check_utf8(m["content"], f"message {i}")
    row_id = obj.get("id", number)
    if not isinstance(row_id, (str, int)) or isinstance(row_id, bool):
        raise InputError(f"\"id\" must be a string or an integer, got {json_type(row_id)}")
    seed = obj.get("seed")
    if seed is not None:
        check_seed(seed, "\"seed\"")
    return PromptLine(number, row_id, prompt, seed)


def _check_utf8(text: str, what: str) -> None:
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as e:  # a lone surrogate, written as a \ud8xx escape
        raise InputError(f"{what} is not valid Unicode text (position {e.start})") from None


class Progress:
    """Progress of an --input run on stderr: on a terminal one line redrawn in place (done/total, tokens/s,
    ETA); otherwise (a log file, a pipe) a plain line every ``every_s`` seconds; and a summary line at the end.
    ``done`` counts the prompts already in the output file; tokens/s and the ETA count this run's alone."""

    def __init__(self, stream, total: int, done_before: int, every_s: float = PROGRESS_EVERY_S, clock=time.monotonic):
        self.stream, self.total, self.before, self.every_s, self.clock = stream, total, done_before, every_s, clock
        self.tty = bool(getattr(stream, "isatty", lambda: False)())
        self.finished = self.tokens = 0
        self.start = self.last = clock()
        self.drawn = 0.0  # when the terminal line was last drawn
        self.shown = False  # a terminal line is on screen

    def status(self) -> str:
        elapsed = max(self.clock() - self.start, 1e-9)
        rate = self.tokens / elapsed
        left = self.total - self.before - self.finished
        eta = _duration(elapsed / self.finished * left) if self.finished else "?"
        return f"{self.before + self.finished}/{self.total} done, {rate:.1f} tokens/s, ETA {eta}"

    def begin(self) -> None:
        if self.tty:
            self._draw()

    def update(self, new_tokens: int) -> None:
        """One more prompt finished, with ``new_tokens`` tokens."""
        self.finished += 1
        self.tokens += new_tokens
        now = self.clock()
        if self.tty:
            if not self.shown or now - self.drawn >= 0.1:  # at most 10 redraws a second
                self._draw()
        elif now - self.last >= self.every_s:
            self.last = now
            print(self.status(), file=self.stream, flush=True)

    def _draw(self) -> None:
        self.drawn = self.clock()
        self.stream.write("\r\033[K" + self.status())
        self.stream.flush()
        self.shown = True

    def clear(self) -> None:
        """Take the terminal line away (before other output on the terminal)."""
        if self.shown:
            self.stream.write("\r\033[K")
            self.stream.flush()
            self.shown = False

    def end(self, output: str) -> None:
        """The summary line, in place of the terminal line."""
        self.clear()
        elapsed = self.clock() - self.start
        before = f"; {self.before} were already in {output}" if self.before else ""
        print(f"{self.before + self.finished}/{self.total} done: {self.finished} prompts, {self.tokens} tokens in "
              f"{elapsed:.1f} s ({self.tokens / max(elapsed, 1e-9):.1f} tokens/s){before}", file=self.stream,
              flush=True)

    def stop(self) -> None:
        """The run ended early (an error or Ctrl-C): keep the last terminal line, if any prompt finished, as a
        line of its own (the error comes after it), else take it away (the error stays the only line)."""
        if self.shown and self.finished:
            self._draw()
            self.stream.write("\n")
            self.stream.flush()
            self.shown = False
        self.clear()


def _duration(seconds: float) -> str:
    seconds = int(round(seconds))
    if seconds >= 3600:
        return f"{seconds // 3600}h{seconds % 3600 // 60:02d}m"
    return f"{seconds // 60}m{seconds % 60:02d}s" if seconds >= 60 else f"{seconds}s"


class _StdoutResults:
    """Result lines on stdout: each written and flushed as its prompt finishes (no resume)."""

    done: set = frozenset()

    def write(self, obj: dict) -> None:
        sys.stdout.write(json.dumps(obj, ensure_ascii=False) + "\n")
        sys.stdout.flush()

    def close(self) -> None:
        pass


def run_batch(args: argparse.Namespace, kwargs: dict) -> int:
    """``generate --input``: every prompt of the file, ``--batch-size`` at a time, each result appended to
    ``--output`` (or stdout) as one JSON line ``{"id": ..., "text": ..., <statistics>}`` when its prompt
    finishes. With an output file, prompts whose id it already holds are skipped: rerunning an interrupted
    command finishes the job."""
    from .jsonl import ResultsFile, id_key

    batch_size = BATCH_SIZE if args.batch_size is None else args.batch_size
    if batch_size < 1:
        raise InputError(f"--batch-size must be at least 1, got {batch_size}")
    if args.output is not None and args.input != "-" and os.path.exists(args.output) \
            and os.path.exists(args.input) and os.path.samefile(args.output, args.input):
        raise InputError(f"--output {args.output} is the --input file")
    from . import parallel

    rows = read_prompt_lines(args.input)
    digests = [prompt_digest(r) for r in rows]
    if not parallel.is_main_rank():  # rank 0 writes; the others decode the same prompts
        out = _StdoutResults()
    elif args.output in (None, "-"):
        out = _StdoutResults()
    else:
        out = ResultsFile(Path(args.output), run_fingerprint(args, kwargs, digests), overwrite=args.overwrite)
    try:
        done = parallel.share(out.done)
        todo_at = [i for i, r in enumerate(rows) if (id_key(r.id), digests[i]) not in done]
        todo = [rows[i] for i in todo_at]
        where = "stdout" if isinstance(out, _StdoutResults) else args.output
        if not todo:
            if not args.quiet:
                print(f"all {len(rows)} prompts are already in {where}", file=sys.stderr)
            return 0
        gen = load_generator(args)
        progress = Progress(sys.stderr, len(rows), len(rows) - len(todo)) if not args.quiet else None
        run = dict(kwargs, seed=[args.seed if r.seed is None else r.seed for r in todo], batch_size=batch_size)
        completed = False
        try:
            if progress:
                progress.begin()
            for index, result in _numbered(gen.generate_many([r.prompt for r in todo], **run), todo):
                if progress and isinstance(out, _StdoutResults):
                    progress.clear()  # stdout may be the same terminal
                out.write({"id": todo[index].id, "prompt_sha256": digests[todo_at[index]], **result.to_dict()})
                if progress:
                    progress.update(result.stats.new_tokens)
            completed = True
        finally:
            if progress and completed:
                progress.end(where)
            elif progress:
                progress.stop()
    finally:
        out.close()
    return 0


def prompt_digest(row: PromptLine) -> str:
    """What a result record names its prompt by: the digest of the prompt (text or messages) and its seed."""
    from .jsonl import fingerprint_digest

    return fingerprint_digest({"prompt": row.prompt, "seed": row.seed})


def run_fingerprint(args: argparse.Namespace, kwargs: dict, digests: list[str]) -> dict:
    """What an --output file's results depend on: the input's prompts (ids and digests, in order), the
    decoding settings, and the model, drafter and dtype (folders as resolved paths). A rerun on the same
    file resumes only when all are equal."""
    from .jsonl import fingerprint_digest

    fuzzy = kwargs["fuzzy"]
    settings = {k: v for k, v in kwargs.items() if k != "fuzzy"}
    settings.update(threshold=fuzzy.threshold if fuzzy.threshold != float("inf") else "inf",
                    divergence=fuzzy.divergence, fuzzy_mode=fuzzy.mode, support_top_k=fuzzy.support_top_k,
                    total_tokens=args.total_tokens, depth=args.depth, tree_top_k=args.tree_top_k,
                    draft_vocab=args.draft_vocab)
    folder = lambda p: os.path.realpath(p) if p else None  # noqa: E731
    return {"input": fingerprint_digest(digests),
            "settings": settings,
            "model": {"target": folder(args.target) or "default", "head": folder(args.head),
                      "draft_model": folder(args.draft_model), "dtype": args.dtype}}


def _numbered(results, rows: list[PromptLine]):
    """generate_many's results, with its "prompt I: ..." errors (I an index into ``rows``) told as
    "input line N: ..."."""
    try:
        yield from results
    except InputError as e:
        m = re.match(r"prompt (\d+): (.*)", str(e), re.S)
        if m and int(m[1]) < len(rows):
            raise InputError(f"input line {rows[int(m[1])].line}: {m[2]}") from None
        raise


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
        args = _parser().parse_args(argv)
        args.argv = list(argv)  # what tensor-parallel ranks started from here run again
        return run_serve(args) if args.command == "serve" else run_generate(args)
    except FSDError as e:
        if _reports():
            print(f"error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("interrupted", file=sys.stderr)
        return 130
    except (RuntimeError, MemoryError) as e:
        return exit_out_of_memory(e, "decode fewer prompts at a time (--batch-size), fewer --max-new-tokens, or "
                                     "a smaller tree (--total-tokens)", _reports())
    except BrokenPipeError:  # the reader of stdout went away (e.g. `| head`): stop quietly
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 1


def _reports() -> bool:
    """Whether this process prints errors: rank 0 of a tensor-parallel launch (every rank meets the same
    bad input), or any process outside one."""
    return os.environ.get("RANK", "0") in ("", "0")  # torchrun's rank of this process


def _parser() -> argparse.ArgumentParser:
    from . import __version__

    parser = OneLineParser(prog="fsd-eagle", description="EAGLE-2 + Fuzzy Speculative Decoding")
    parser.add_argument("--version", action="version", version=f"fsd-eagle {__version__}")
    sub = parser.add_subparsers(dest="command", required=True)
    _generate_parser(sub)
    _serve_parser(sub)
    sub.add_parser("train", help="train a draft head (runs training/ from a checkout)", add_help=False)
    sub.add_parser("bench", help="run benchmarks (runs eval/ from a checkout)", add_help=False)
    return parser


def exit_with(code: int):
    """Leave the process with ``code``. After a Ctrl-C (130) the process leaves at once, stdio flushed:
    CPython 3.11 otherwise ends it by SIGINT instead of the status when the interrupt struck code run by
    exec() (e.g. while an import creates dataclasses), even though the interrupt was handled. A rank of a
    tensor-parallel launch leaves the same way once its process group is destroyed: the interpreter's
    teardown can abort a gloo rank after its work is done ("terminate called without an active exception",
    a backend thread destroyed while joinable), which would turn the launch's status into a failure."""
    dist = sys.modules.get("torch.distributed")
    joined = dist is not None and dist.is_available() and dist.is_initialized()
    if joined:
        from .parallel import leave

        leave()
    if code == 130 or joined:
        for stream in (sys.stdout, sys.stderr):
            try:
                stream.flush()
            except (OSError, ValueError):
                pass
        os._exit(code)
    sys.exit(code)


def script() -> None:
    """The ``fsd-eagle`` executable."""
    exit_with(main())


if __name__ == "__main__":
    script()

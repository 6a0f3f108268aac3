"""Scoring helpers for the benchmarks: answer extraction, reference parsing, token agreement.

Everything here is pure text processing (no model, no I/O), so it is cheap to test.

* GSM8K: :func:`extract_gsm8k_answer` reads the final number of a model's answer,
  :func:`gsm8k_reference` reads the dataset's reference ("... #### 18"); both return the
  same normalized form ("1,234.50" -> "1234.5", "3.0" -> "3"), so compare them with ``==``.
* MMLU: :func:`extract_mmlu_letter` reads the chosen letter (A-D) of a model's answer.
* HumanEval: :func:`humaneval_completion_code` turns a chat answer into a program that
  :func:`eval.humaneval_exec.check_program` can run.
* Speculative decoding: :func:`token_agreement` compares two token sequences (e.g. the
  output of fuzzy speculative decoding with the target model's own greedy output).
"""

from __future__ import annotations

import re

from fsd_eagle.errors import InputError

__all__ = [
    "extract_gsm8k_answer",
    "gsm8k_reference",
    "normalize_number",
    "extract_mmlu_letter",
    "token_agreement",
    "humaneval_completion_code",
]

# ---------------------------------------------------------------------------------------
# GSM8K
# ---------------------------------------------------------------------------------------

# A number as written in an answer: optional sign glued to it ("-5", "-$5"; a bullet "- 5"
# is not a sign), optional "$", digits with optional thousands separators ("1,234,567"),
# optional decimals. The look-behind keeps the "-" of a range such as "3-5" from being
# read as a sign, and keeps "2.5" from yielding a stray "5".
_NUMBER = re.compile(
    r"(?<![\w.])(?P<sign>[-\u2212](?=\$?\d))?(?:\$\s?)?"
    r"(?P<int>\d{1,3}(?:,\d{3})+(?!\d)|\d+)(?P<frac>\.\d+)?"
)
# Phrases that announce the final answer; the number must follow on the same line.
_ANSWER_IS = re.compile(r"\banswer\s*(?:is|:)", re.IGNORECASE)
_HASHES = re.compile(r"####")
_BOXED = re.compile(r"\\boxed\s*\{")


def normalize_number(sign: str | None, integer: str, fraction: str | None) -> str:
    """Canonical text of a number: no separators, no trailing zeros, no "-0".

    >>> normalize_number("-", "1,200", ".50")
    '-1200.5'
    """
    digits = str(int(integer.replace(",", "")))
    frac = (fraction or "").lstrip(".").rstrip("0")
    text = digits + ("." + frac if frac else "")
    if sign and text != "0":
        text = "-" + text
    return text


def _first_number(text: str) -> str | None:
    m = _NUMBER.search(text)
    return None if m is None else normalize_number(m["sign"], m["int"], m["frac"])


def _last_number(text: str) -> str | None:
    found = None
    for m in _NUMBER.finditer(text):
        found = m
    return None if found is None else normalize_number(found["sign"], found["int"], found["frac"])


def _number_after(markers: re.Pattern[str], text: str) -> str | None:
    """The first number on the same line after the last marker that has one."""
    for m in reversed(list(markers.finditer(text))):
        rest = text[m.end():].split("\n", 1)[0]
        number = _first_number(rest)
        if number is not None:
            return number
    return None


def extract_gsm8k_answer(text: str) -> str | None:
    """The final numeric answer of a GSM8K solution written by a model, or None.

    Order of preference:

    1. the number after the last "#### " (the dataset's own format, strict);
    2. the number after the last "The answer is" / "answer:" that has one on its line
       (the instruction of :func:`eval.tasks.gsm8k_prompt` asks for "The answer is N.");
    3. the number inside the last ``\\boxed{...}``;
    4. otherwise the last number anywhere in the text.

    The number is normalized: "$", "," and trailing zeros removed, so "$1,234.50" gives
    "1234.5" and "3.0" gives "3"; a leading "-" (or U+2212) is kept. Returns None when the
    text holds no number at all.
    """
    for markers in (_HASHES, _ANSWER_IS, _BOXED):
        number = _number_after(markers, text)
        if number is not None:
            return number
    return _last_number(text)


def gsm8k_reference(answer_field: str) -> str:
    """The reference answer of a GSM8K record: the number after its "#### ", normalized
    exactly like :func:`extract_gsm8k_answer` does ("#### 1,000" -> "1000").

    Raises InputError when the field has no "#### " followed by a number.
    """
    if "####" not in answer_field:
        raise InputError("GSM8K answer field has no '#### <number>' final answer")
    tail = answer_field.rsplit("####", 1)[1].strip()
    number = _first_number(tail)
    if number is None:
        raise InputError(f"GSM8K answer field has no number after '####': {tail[:40]!r}")
    return number


# ---------------------------------------------------------------------------------------
# MMLU
# ---------------------------------------------------------------------------------------

# A letter A-D standing alone: not part of a word ("Dog", "AD"), not glued to "-" or "'"
# ("D-day", "A's"), and not the English article: an "A" followed by a space and a
# lower-case word is skipped ("A cat"), unless that word is a verb or link word that makes
# it a letter ("A is correct", "A because ...").
_NOT_ARTICLE = r"(?:is|was|seems|would|could|should|must|and|or|because|since|as|fits)\b"
_LETTER = (
    r"(?<![\w'\-])(?:(?P<letter>[BCD])|(?P<a>A)(?!\s+(?!" + _NOT_ARTICLE + r")[a-z]))"
    r"(?![\w'\-])"
)
# "Answer: B", "the answer is (C)", "correct answer is option D", "Answer - **A**".
_LETTER_AFTER_ANSWER = re.compile(
    r"\banswer\b(?:\s+is)?\s*(?:[:=\-]\s*)?(?:\*\*|__)?\s*(?:(?:option|choice)\s+)?[(\[]?"
    r"(?P<letter>[ABCD])(?![\w'\-])",
    re.IGNORECASE,
)
_STANDALONE_LETTER = re.compile(_LETTER)


def extract_mmlu_letter(text: str) -> str | None:
    """The answer letter (A, B, C or D) chosen in a model's MMLU answer, or None.

    1. If the text says "answer" followed by a letter ("Answer: B", "The answer is (C)",
       "the correct answer is option D", "Answer: **A**"), the first such letter wins.
    2. Otherwise the first standalone capital A-D: "B", "B.", "(C)", "**D**", "C) 42".
       A letter inside a word ("Dog", "ABC"), glued to "-"/"'" ("D-day", "A's") or used
       as the article ("A good choice is ...") is not an answer; "A is correct" is.

    Only capital letters are read, also after "answer" ("answer: b" gives None), since a
    lone lower-case "a" is normally the article. Returns None when no letter is found.
    """
    for m in _LETTER_AFTER_ANSWER.finditer(text):
        # re.IGNORECASE also lets [ABCD] match a-d: accept only real capitals.
        if m["letter"].isupper():
            return m["letter"]
    m = _STANDALONE_LETTER.search(text)
    return None if m is None else (m["letter"] or m["a"])


# ---------------------------------------------------------------------------------------
# Token agreement
# ---------------------------------------------------------------------------------------


def token_agreement(a: list[int], b: list[int]) -> float:
    """Fraction of positions where two token sequences hold the same token.

    Positions are compared index by index; the denominator is the longer length, so the
    extra tail of the longer sequence counts as disagreement: ``[1, 2, 3]`` vs ``[1, 2]``
    gives 2/3. Two empty sequences agree fully (1.0).
    """
    longest = max(len(a), len(b))
    if longest == 0:
        return 1.0
    same = sum(1 for x, y in zip(a, b) if x == y)
    return same / longest


# ---------------------------------------------------------------------------------------
# HumanEval
# ---------------------------------------------------------------------------------------

# An opening fence: ``` followed by an optional language tag, then the end of the line.
_FENCE_OPEN = re.compile(r"^[ \t]*```[ \t]*(?P<lang>[\w+\-.]*)[ \t]*$", re.MULTILINE)
_FENCE_CLOSE = re.compile(r"^[ \t]*```[ \t]*$", re.MULTILINE)
_PYTHON_TAGS = {"python", "py", "python3"}
_TOP_LEVEL_DEF = re.compile(r"^(?:async[ \t]+)?def[ \t]+(?P<name>\w+)[ \t]*\(", re.MULTILINE)


def _fenced_blocks(text: str) -> list[tuple[str, str]]:
    """(language tag, body) of each fenced block; an unclosed last block (a generation cut
    off by the token limit) runs to the end of the text."""
    blocks = []
    pos = 0
    while True:
        start = _FENCE_OPEN.search(text, pos)
        if start is None:
            return blocks
        body_start = start.end() + 1  # skip the newline after the tag
        end = _FENCE_CLOSE.search(text, body_start)
        if end is None:
            blocks.append((start["lang"].lower(), text[body_start:]))
            return blocks
        blocks.append((start["lang"].lower(), text[body_start:end.start()]))
        pos = end.end()


def _entry_point_of(prompt: str) -> str | None:
    """The function a HumanEval prompt asks for: its last top-level ``def``."""
    names = [m["name"] for m in _TOP_LEVEL_DEF.finditer(prompt)]
    return names[-1] if names else None


def humaneval_completion_code(prompt: str, completion: str, entry_point: str | None = None) -> str:
    """The program to test for a HumanEval problem, given the model's answer.

    ``prompt`` is the problem's prompt (imports, helpers, and the signature + docstring of
    the function to write); ``entry_point`` is that function's name (default: the last
    top-level ``def`` of the prompt).

    * The answer holds a fenced code block (```python, ```py, ```python3; a bare ``` block
      is used only when no tagged one exists; an unclosed fence runs to the end):

      - if a block defines the function (a top-level ``def <entry_point>(``), that block is
        used whole. It is placed *after* the prompt, so the prompt's imports and helper
        functions stay available and the block's definition replaces the prompt's stub (a
        function whose body is only its docstring, which is valid Python);
      - otherwise the first block is taken as the function's body and appended to the
        prompt.

    * No fenced block: the answer is a plain continuation, returned as prompt + completion
      (if it starts with its own ``def``, the same replacement rule applies naturally).
    """
    name = entry_point or _entry_point_of(prompt)
    blocks = _fenced_blocks(completion)
    python = [body for lang, body in blocks if lang in _PYTHON_TAGS]
    candidates = python or [body for lang, body in blocks if lang == ""]
    if not candidates:
        return prompt + completion
    for body in candidates:
        if name and any(m["name"] == name for m in _TOP_LEVEL_DEF.finditer(body)):
            return prompt.rstrip("\n") + "\n\n\n" + body.rstrip() + "\n"
    return prompt + candidates[0].rstrip() + "\n"

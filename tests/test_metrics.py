"""Tests of eval/metrics.py, eval/tasks.py and eval/humaneval_exec.py (fast: a few seconds)."""

from __future__ import annotations

import gzip
import json
import time

import pytest

from eval.humaneval_exec import check_program, run_many
from eval.metrics import (
    extract_gsm8k_answer,
    extract_mmlu_letter,
    gsm8k_reference,
    humaneval_completion_code,
    token_agreement,
)
from eval.tasks import (
    GSM8KProblem,
    gsm8k_prompt,
    humaneval_prompt,
    load_gsm8k,
    load_humaneval,
    load_mmlu,
    load_mt_bench,
    load_spec_bench,
    mmlu_prompt,
)
from fsd_eagle.errors import InputError

# --------------------------------------------------------------------------------------
# GSM8K
# --------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "text, expected",
    [
        ("The answer is 18.", "18"),
        ("She makes 9 * 2 = $18 every day.\n#### 18", "18"),
        ("So the total is 1,234 apples. The answer is 1,234.", "1234"),
        ("The answer is $1,000,000.", "1000000"),
        ("The temperature drops to -5 degrees. The answer is -5.", "-5"),
        ("The answer is 3.0", "3"),
        ("The answer is 2.50 dollars.", "2.5"),
        ("The answer is 0.75.", "0.75"),
        # several numbers: the explicit answer wins over later ones ...
        ("The answer is 42.\nCheck: 40 + 2 = 42, and 7 * 6 = 42 too, not 41.", "42"),
        # ... and without one, the last number counts
        ("First 3 + 4 = 7, then 7 * 2 = 14", "14"),
        ("She pays $12.00 in total", "12"),
        ("#### 1,000", "1000"),
        ("The final answer is: **27**", "27"),
        ("Therefore the answer is \\boxed{96}.", "96"),
        ("Answer: 7 apples", "7"),
        ("It costs 3-5 dollars", "5"),  # a range is not a negative number
        ("- 5 eggs are left", "5"),  # a bullet is not a sign
        ("x = \u22124", "-4"),  # Unicode minus
        ("The answer is -0.0", "0"),
        ("I cannot solve this.", None),
        ("", None),
    ],
)
def test_extract_gsm8k_answer(text, expected):
    assert extract_gsm8k_answer(text) == expected


def test_extract_gsm8k_answer_marker_without_number_falls_back():
    assert extract_gsm8k_answer("The answer is below.\nWe get 12 then 15") == "15"


def test_gsm8k_reference():
    assert gsm8k_reference("Janet sells 16 - 3 - 4 = <<16-3-4=9>>9 duck eggs.\n#### 18") == "18"
    assert gsm8k_reference("... \n#### 1,200") == "1200"
    assert gsm8k_reference("#### -3") == "-3"
    with pytest.raises(InputError):
        gsm8k_reference("no final answer here")
    with pytest.raises(InputError):
        gsm8k_reference("#### none")


def test_gsm8k_reference_matches_extractor_on_the_test_split():
    for problem in load_gsm8k("test"):
        assert extract_gsm8k_answer(problem.answer) == problem.reference


# --------------------------------------------------------------------------------------
# MMLU
# --------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "text, expected",
    [
        ("B", "B"),
        ("B.", "B"),
        ("(C)", "C"),
        ("C) 42", "C"),
        ("**D**", "D"),
        ("Answer: B", "B"),
        ("Answer: (C)", "C"),
        ("Answer: **A**", "A"),
        ("The answer is D.", "D"),
        ("The correct answer is option B, because ...", "B"),
        ("Option A is wrong since x > 0. Answer: C", "C"),  # the explicit answer wins
        ("A good way to see it: the answer is B", "B"),  # "A" as an article is skipped
        ("A is correct.", "A"),
        ("I think B is right.", "B"),
        ("D-day happened in 1944, so C", "C"),  # "D-day" is a word, not a letter
        ("Dogs and Cats", None),
        ("answer: b", None),  # only capitals are read
        ("None of the options", None),
        ("", None),
    ],
)
def test_extract_mmlu_letter(text, expected):
    assert extract_mmlu_letter(text) == expected


# --------------------------------------------------------------------------------------
# Token agreement
# --------------------------------------------------------------------------------------


def test_token_agreement():
    assert token_agreement([1, 2, 3], [1, 2, 3]) == 1.0
    assert token_agreement([1, 2, 3], [1, 9, 3]) == pytest.approx(2 / 3)
    assert token_agreement([1, 2, 3, 4], [1, 2]) == 0.5  # the longer length counts
    assert token_agreement([1, 2], [1, 2, 3, 4]) == 0.5
    assert token_agreement([5, 6], [6, 5]) == 0.0
    assert token_agreement([], [1]) == 0.0
    assert token_agreement([], []) == 1.0


# --------------------------------------------------------------------------------------
# Loaders and prompts
# --------------------------------------------------------------------------------------


def test_load_spec_bench():
    questions = load_spec_bench()
    assert len(questions) == 480
    assert len({q.question_id for q in questions}) == 480
    assert len({q.category for q in questions}) == 13
    subtasks = {}
    for q in questions:
        subtasks[q.subtask] = subtasks.get(q.subtask, 0) + 1
    assert subtasks == {
        "mt_bench": 80,
        "translation": 80,
        "summarization": 80,
        "qa": 80,
        "math_reasoning": 80,
        "rag": 80,
    }
    assert all(q.turns and all(isinstance(t, str) for t in q.turns) for q in questions)
    rag = [q for q in questions if q.category == "rag"]
    assert all(isinstance(q.reference[0], list) for q in rag)  # lists of acceptable answers
    assert [q.question_id for q in load_spec_bench(limit=5)] == [81, 82, 83, 84, 85]


def test_load_mt_bench():
    questions = load_mt_bench()
    assert len(questions) == 80
    assert all(len(q.turns) == 2 for q in questions)
    assert len({q.category for q in questions}) == 8
    assert load_mt_bench(limit=0) == []


def test_load_gsm8k():
    test = load_gsm8k("test")
    assert len(test) == 1319
    assert test[0].reference == "18" and "Janet" in test[0].question
    assert len(load_gsm8k("train", limit=10)) == 10
    with pytest.raises(InputError):
        load_gsm8k("validation")


def test_load_humaneval():
    problems = load_humaneval()
    assert len(problems) == 164
    assert problems[0].task_id == "HumanEval/0"
    assert problems[0].entry_point == "has_close_elements"


def test_load_mmlu():
    questions = load_mmlu()
    assert len(questions) == 14042
    assert len({q.topic for q in questions}) == 57
    assert {q.answer for q in questions} == {"A", "B", "C", "D"}
    assert all(len(q.choices) == 4 for q in questions)
    assert len(load_mmlu(limit=3)) == 3


def test_loaders_report_bad_files(tmp_path):
    with pytest.raises(InputError, match="not found"):
        load_mt_bench(data_dir=tmp_path)
    (tmp_path / "mt_bench").mkdir()
    (tmp_path / "mt_bench" / "question.jsonl").write_text('{"question_id": 1, "category": "x", "turns": ["hi"]}\n{oops\n')
    with pytest.raises(InputError, match="line 2: not valid JSON"):
        load_mt_bench(data_dir=tmp_path)
    assert len(load_mt_bench(limit=1, data_dir=tmp_path)) == 1
    (tmp_path / "mt_bench" / "question.jsonl").write_text('{"question_id": 1, "category": "x"}\n')
    with pytest.raises(InputError, match="'turns'"):
        load_mt_bench(data_dir=tmp_path)
    (tmp_path / "mmlu").mkdir()
    record = {"question": "q", "answer_a": "1", "answer_b": "2", "answer_c": "3", "answer_d": "4", "topic": "t"}
    header = dict.fromkeys(record, "") | {"question": "question", "correct_answer": "answer"}
    with gzip.open(tmp_path / "mmlu" / "mmlu.jsonl.gz", "wt") as f:
        f.write(json.dumps(header) + "\n" + json.dumps(record | {"correct_answer": "B"}) + "\n")
    assert [q.answer for q in load_mmlu(data_dir=tmp_path)] == ["B"]  # header record skipped
    with gzip.open(tmp_path / "mmlu" / "mmlu.jsonl.gz", "wt") as f:
        f.write(json.dumps(record | {"correct_answer": "E"}) + "\n")
    with pytest.raises(InputError, match="A, B, C or D"):
        load_mmlu(data_dir=tmp_path)
    with pytest.raises(InputError):
        load_mmlu(limit=-1)


def test_prompts():
    problem = load_gsm8k("test", limit=1)[0]
    text = gsm8k_prompt(problem)
    assert text.startswith(problem.question.strip()) and "The answer is N." in text
    assert gsm8k_prompt(GSM8KProblem(0, "What is 2+2?", "#### 4", "4")) == gsm8k_prompt("What is 2+2?")

    question = load_mmlu(limit=1)[0]
    text = mmlu_prompt(question)
    assert question.question in text and f"A. {question.choices[0]}" in text and f"D. {question.choices[3]}" in text
    assert "(A, B, C or D)" in text

    he = load_humaneval(limit=1)[0]
    text = humaneval_prompt(he)
    assert he.prompt.rstrip() in text and "```python" in text


# --------------------------------------------------------------------------------------
# HumanEval completion extraction
# --------------------------------------------------------------------------------------

PROMPT = 'def add(a, b):\n    """Return a + b."""\n'


def test_completion_code_plain_continuation():
    assert humaneval_completion_code(PROMPT, "    return a + b\n") == PROMPT + "    return a + b\n"


def test_completion_code_fenced_body_is_appended():
    reply = "Here you go:\n```python\n    return a + b\n```\nDone."
    assert humaneval_completion_code(PROMPT, reply) == PROMPT + "    return a + b\n"


def test_completion_code_fenced_function_is_used_whole():
    reply = "```python\ndef add(a, b):\n    return a + b\n```"
    code = humaneval_completion_code(PROMPT, reply)
    assert code.startswith(PROMPT)  # the prompt's imports and helpers stay available
    assert code.endswith("def add(a, b):\n    return a + b\n")
    namespace: dict = {}
    exec(compile(code, "<test>", "exec"), namespace)  # our own fixed code, not model output
    assert namespace["add"](2, 3) == 5


def test_completion_code_picks_python_block_and_unclosed_fence():
    reply = "```text\nnot code\n```\n```py\ndef add(a, b):\n    return a + b\n"
    assert humaneval_completion_code(PROMPT, reply).endswith("def add(a, b):\n    return a + b\n")


# --------------------------------------------------------------------------------------
# HumanEval execution
# --------------------------------------------------------------------------------------

# Our own solution of HumanEval/0 (has_close_elements): sort, then compare neighbours.
HUMANEVAL_0_REPLY = """Sure! Sorting makes close numbers neighbours:

```python
from typing import List


def has_close_elements(numbers: List[float], threshold: float) -> bool:
    ordered = sorted(numbers)
    return any(b - a < threshold for a, b in zip(ordered, ordered[1:]))
```
"""


@pytest.fixture(scope="module")
def humaneval_0():
    return load_humaneval(limit=1)[0]


def test_check_program_passes(humaneval_0):
    program = humaneval_completion_code(humaneval_0.prompt, HUMANEVAL_0_REPLY)
    assert check_program(program, humaneval_0.test, humaneval_0.entry_point) == (True, "passed")


def test_check_program_fails(humaneval_0):
    program = humaneval_0.prompt + "    return False\n"
    passed, status = check_program(program, humaneval_0.test, humaneval_0.entry_point)
    assert not passed and status.startswith("failed: AssertionError")


def test_check_program_syntax_error(humaneval_0):
    passed, status = check_program(humaneval_0.prompt + "    return (\n", humaneval_0.test, humaneval_0.entry_point)
    assert not passed and status.startswith("failed: SyntaxError")


def test_check_program_early_exit_does_not_pass(humaneval_0):
    for body in ("    import sys; sys.exit(0)\n", "    import os; os._exit(0)\n"):
        passed, status = check_program(humaneval_0.prompt + body, humaneval_0.test, humaneval_0.entry_point)
        assert not passed and status.startswith("failed"), status


def test_check_program_times_out(humaneval_0):
    program = humaneval_0.prompt + "    while True:\n        pass\n"
    start = time.monotonic()
    passed, status = check_program(program, humaneval_0.test, humaneval_0.entry_point, timeout_s=2.0)
    elapsed = time.monotonic() - start
    assert (passed, status) == (False, "timed out")
    assert elapsed < 5.0


def test_check_program_memory_limit(humaneval_0):
    program = humaneval_0.prompt + "    block = bytearray(8 * 1024 ** 3)\n    return True\n"
    start = time.monotonic()
    passed, status = check_program(program, humaneval_0.test, humaneval_0.entry_point, memory_mb=512)
    assert not passed and status.startswith("failed: MemoryError"), status
    assert time.monotonic() - start < 5.0


def test_check_program_rejects_bad_entry_point():
    with pytest.raises(InputError):
        check_program("x = 1", "def check(c): pass", "f); import os; (")


def test_run_many_keeps_order(humaneval_0):
    good = humaneval_completion_code(humaneval_0.prompt, HUMANEVAL_0_REPLY)
    bad = humaneval_0.prompt + "    return True\n"
    jobs = [(good, humaneval_0.test, humaneval_0.entry_point), (bad, humaneval_0.test, humaneval_0.entry_point)] * 2
    results = run_many(jobs, workers=2)
    assert [passed for passed, _ in results] == [True, False, True, False]
    assert run_many([]) == []

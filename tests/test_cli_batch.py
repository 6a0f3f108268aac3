"""Tests of ``fsd-eagle generate --input FILE`` (JSON lines of prompts in, JSON lines of results out) on a tiny
random model saved to disk: results equal to one-prompt runs, resume after an interruption or a torn last
line, bad input refused with one ``error: input line N: ...`` line before the model loads, stdin, progress."""

from __future__ import annotations

import io
import json
import os
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest

from fsd_eagle import cli
from fsd_eagle.cli import Progress, main
from test_api import save_target_and_head
from test_cli import ENV

PROMPTS = ["w5 w17 w99 w3 w42 w64 w8", "w7 w7 w8", "w100 w3 w50 w61 w20 w9 w31 w44 w12", "w11"]
ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def folders(tmp_path_factory):
    return save_target_and_head(tmp_path_factory.mktemp("cli_batch_models"), head_seed=3)


def model_args(folders, target=None):
    return ["--target", str(target or folders / "target"), "--head", str(folders / "head"), "--device", "cpu",
            "--dtype", "float32", "--max-new-tokens", "12", "--total-tokens", "8", "--depth", "4", "--tree-top-k", "2"]


def write_lines(path: Path, *lines) -> Path:
    path.write_text("".join((line if isinstance(line, str) else json.dumps(line)) + "\n" for line in lines))
    return path


def read_results(path: Path) -> list[dict]:
    """The result records of an --output file (its first line is the run's header)."""
    header, *records = [json.loads(line) for line in path.read_text().splitlines()]
    assert header["format"] == "fsd-eagle generate results" and set(header["fingerprint"]) == {"input", "settings",
                                                                                                 "model"}
    return records


def run(capfd, argv):
    rc = main(argv)
    out, err = capfd.readouterr()
    return rc, out, err


@pytest.fixture(scope="module")
def single(folders):
    """--json of each prompt run alone (greedy, and sampling with seeds 0 and 7)."""
    capfd = _Capture()
    runs = {}
    for p in PROMPTS:
        runs[p] = run_json(capfd, ["generate", p, *model_args(folders)])
        for seed in (0, 7):
            runs[p, seed] = run_json(capfd, ["generate", p, *model_args(folders), "--temperature", "0.9",
                                             "--seed", str(seed)])
    return runs


class _Capture:
    """capfd for a module fixture: the CLI's stdout and stderr of one call."""

    def __init__(self):
        self.out, self.err = io.StringIO(), io.StringIO()

    def readouterr(self):
        out, err = self.out.getvalue(), self.err.getvalue()
        self.out.seek(0), self.out.truncate(), self.err.seek(0), self.err.truncate()
        return out, err


def run_json(capture, argv):
    """``main(argv + ["--json"])``'s object, stdout and stderr redirected by hand (a module fixture has no capfd)."""
    old = sys.stdout, sys.stderr
    sys.stdout, sys.stderr = capture.out, capture.err
    try:
        rc = main(argv + ["--json"])
    finally:
        sys.stdout, sys.stderr = old
    out, err = capture.readouterr()
    assert rc == 0, err
    return json.loads(out)


SAME = ("text", "new_tokens", "target_forwards", "stop_reason")


# ---------------------------------------------------------------------------------------- good runs


def test_results_equal_single_prompt_runs(folders, single, tmp_path, capfd):
    """Every line of the file gives what the prompt gives alone; ids: given, or the line number; chat
    messages equal the text prompt (the chat template wraps a text prompt as one user message)."""
    src = write_lines(tmp_path / "in.jsonl", {"prompt": PROMPTS[0]}, "", {"id": "two", "prompt": PROMPTS[1]},
                      {"id": 30, "messages": [{"role": "user", "content": PROMPTS[2]}], "note": "ignored"},
                      {"prompt": PROMPTS[3]})
    out = tmp_path / "out.jsonl"
    rc, stdout, err = run(capfd, ["generate", "--input", str(src), "--output", str(out), "--batch-size", "2",
                                  *model_args(folders)])
    assert rc == 0 and stdout == ""
    results = {r["id"]: r for r in read_results(out)}  # in completion order: any order
    assert sorted(map(str, results)) == sorted(map(str, [1, "two", 30, 5]))
    for key, prompt in zip([1, "two", 30, 5], PROMPTS):
        r = results[key]
        assert list(r)[0] == "id"
        assert {k: r[k] for k in SAME} == {k: single[prompt][k] for k in SAME}, r["id"]
    # stderr not a terminal, a short run: only the summary line
    assert err.count("\n") == 1 and err.startswith("4/4 done: 4 prompts, ") and "\r" not in err


def test_per_line_seeds(folders, single, tmp_path, capfd):
    src = write_lines(tmp_path / "in.jsonl", {"prompt": PROMPTS[0], "seed": 7}, {"prompt": PROMPTS[1]},
                      {"prompt": PROMPTS[2], "seed": 0})
    rc, stdout, _ = run(capfd, ["generate", "--input", str(src), *model_args(folders), "--temperature", "0.9",
                                "--seed", "7", "--quiet"])
    assert rc == 0
    got = {r["id"]: r["text"] for r in map(json.loads, stdout.splitlines())}
    assert got == {1: single[PROMPTS[0], 7]["text"], 2: single[PROMPTS[1], 7]["text"],
                   3: single[PROMPTS[2], 0]["text"]}


def test_lines_in_completion_order(folders, tmp_path, capfd, monkeypatch):
    """Lines are written in the order prompts finish (whatever generate_many yields), each with its own id."""
    src = write_lines(tmp_path / "in.jsonl", *({"id": f"p{i}", "prompt": p} for i, p in enumerate(PROMPTS)))
    seen = {}

    class Reversed:
        def generate_many(self, prompts, **kw):
            seen.update(kw, prompts=prompts)
            for i in reversed(range(len(prompts))):
                yield i, fake_result(prompts[i])

    monkeypatch.setattr(cli, "load_generator", lambda args: Reversed())
    rc, stdout, _ = run(capfd, ["generate", "--input", str(src), *model_args(folders), "--batch-size", "3"])
    assert rc == 0
    results = [json.loads(line) for line in stdout.splitlines()]
    assert [(r["id"], r["text"]) for r in results] == [(f"p{i}", f"re: {PROMPTS[i]}") for i in (3, 2, 1, 0)]
    assert seen["batch_size"] == 3 and seen["seed"] == [0] * 4 and seen["max_new_tokens"] == 12
    rc, _, _ = run(capfd, ["generate", "--input", str(src), *model_args(folders)])
    assert seen["batch_size"] == cli.BATCH_SIZE


def fake_result(prompt):
    return SimpleNamespace(stats=SimpleNamespace(new_tokens=3), to_dict=lambda: {"text": f"re: {prompt}"})


def test_resume_after_interrupt_and_torn_line(folders, single, tmp_path, capfd, monkeypatch):
    """Ctrl-C keeps the finished lines (exit 130); a torn last line (a kill mid-write) is cut away; rerunning
    the same command generates only what is missing, and the file ends as one uninterrupted run's."""
    src = write_lines(tmp_path / "in.jsonl", *({"prompt": p} for p in PROMPTS))
    out = tmp_path / "out.jsonl"
    argv = ["generate", "--input", str(src), "--output", str(out), *model_args(folders)]
    real = cli.load_generator

    class Interrupted:
        def __init__(self, args):
            self.gen = real(args)

        def generate_many(self, prompts, **kw):
            for n, item in enumerate(self.gen.generate_many(prompts, **kw)):
                if n == 2:
                    raise KeyboardInterrupt
                yield item

    monkeypatch.setattr(cli, "load_generator", Interrupted)
    rc, _, err = run(capfd, argv)
    assert rc == 130 and err.splitlines()[-1] == "interrupted"
    first = [r["id"] for r in read_results(out)]  # the two that finished first (completion order)
    assert len(first) == 2 and set(first) <= {1, 2, 3, 4}
    monkeypatch.setattr(cli, "load_generator", real)

    missing = sorted({1, 2, 3, 4} - set(first))
    with open(out, "ab") as f:  # a kill in the middle of writing the third line
        f.write(b'{"id": %d, "prompt_sha256": "ab' % missing[0])
    rc, _, err = run(capfd, argv)
    assert rc == 0, err
    assert "2 prompts" in err and "2 were already in" in err
    results = read_results(out)
    assert [r["id"] for r in results][:2] == first and sorted(r["id"] for r in results) == [1, 2, 3, 4]
    assert {r["id"]: r["text"] for r in results} == {i + 1: single[p]["text"] for i, p in enumerate(PROMPTS)}

    # all done: nothing to generate, the model is not even loaded
    monkeypatch.setattr(cli, "load_generator", lambda args: pytest.fail("the model was loaded"))
    rc, _, err = run(capfd, argv)
    assert rc == 0 and err == f"all 4 prompts are already in {out}\n"
    assert read_results(out) == results


def test_stdin_to_stdout_process(folders):
    """As a process: prompts piped to --input -, results on stdout, one summary line on stderr (not a terminal)."""
    lines = "".join(json.dumps({"id": f"q{i}", "prompt": p}) + "\n" for i, p in enumerate(PROMPTS[:2]))
    proc = subprocess.run([sys.executable, "-m", "fsd_eagle.cli", "generate", "--input", "-", *model_args(folders)],
                          input=lines, capture_output=True, text=True, env=dict(ENV, PYTHONPATH=str(ROOT)),
                          timeout=120)
    assert proc.returncode == 0, proc.stderr
    assert [json.loads(line)["id"] for line in proc.stdout.splitlines()] == ["q0", "q1"]
    assert proc.stderr.startswith("2/2 done: 2 prompts, ") and proc.stderr.count("\n") == 1


def test_stdin_in_process_and_quiet(folders, single, capfd, monkeypatch):
    monkeypatch.setattr(sys, "stdin", io.TextIOWrapper(io.BytesIO(json.dumps({"prompt": PROMPTS[1]}).encode())))
    rc, stdout, err = run(capfd, ["generate", "--input", "-", *model_args(folders), "--quiet"])
    assert rc == 0 and err == ""
    assert json.loads(stdout)["text"] == single[PROMPTS[1]]["text"]


# ------------------------------------------------------------------------------------ progress


class Clock:
    def __init__(self):
        self.t = 100.0

    def __call__(self):
        return self.t


class Stream(io.StringIO):
    def __init__(self, tty):
        super().__init__()
        self.tty = tty

    def isatty(self):
        return self.tty


def test_progress_on_a_terminal_redraws_one_line():
    clock, stream = Clock(), Stream(tty=True)
    p = Progress(stream, total=10, done_before=2, clock=clock)
    p.begin()
    for _ in range(4):
        clock.t += 2.0
        p.update(50)
    assert stream.getvalue().endswith("\r\033[K6/10 done, 25.0 tokens/s, ETA 8s")
    assert "\n" not in stream.getvalue()
    p.end("out.jsonl")
    last = stream.getvalue().split("\r\033[K")[-1]
    assert last == "6/10 done: 4 prompts, 200 tokens in 8.0 s (25.0 tokens/s); 2 were already in out.jsonl\n"


def test_progress_in_a_log_prints_plain_lines_now_and_then():
    clock, stream = Clock(), Stream(tty=False)
    p = Progress(stream, total=100, done_before=0, every_s=30, clock=clock)
    p.begin()
    for _ in range(50):
        clock.t += 1.0
        p.update(10)
    assert stream.getvalue().splitlines() == ["30/100 done, 10.0 tokens/s, ETA 1m10s"]
    p.stop()  # an interruption adds nothing to a log
    assert stream.getvalue().count("\n") == 1 and "\r" not in stream.getvalue()


def test_progress_line_kept_or_cleared_on_errors():
    stream = Stream(tty=True)
    p = Progress(stream, total=3, done_before=0, clock=Clock())
    p.begin()
    p.stop()  # nothing finished: the line goes, the error line will be alone
    assert stream.getvalue().endswith("\r\033[K") and "\n" not in stream.getvalue()
    clock = Clock()
    p = Progress(stream, total=3, done_before=0, clock=clock)
    p.begin()
    clock.t += 1.0
    p.update(5)
    p.stop()
    assert stream.getvalue().endswith("\r\033[K1/3 done, 5.0 tokens/s, ETA 2s\n")


# ------------------------------------------------------------------------------------ bad input

BAD_LINES = {
    "not JSON": ("{prompt: 1}", "not valid JSON"),
    "a list": ("[1, 2]", "expected a JSON object, got a list"),
    "no prompt": ({"id": 4}, 'needs a "prompt" (text) or "messages" (a chat)'),
    "both": ({"prompt": "w5", "messages": [{"role": "user", "content": "w5"}]}, "not both"),
    "empty prompt": ({"prompt": ""}, "the prompt is empty"),
    "blank prompt": ({"prompt": " \n "}, "the prompt is empty"),
    "prompt a number": ({"prompt": 5}, '"prompt" must be a string, got an integer'),
    "prompt token ids": ({"prompt": [5, 6]}, '"prompt" must be a string, got a list'),
    "empty messages": ({"messages": []}, '"messages" must be a non-empty list'),
    "message without content": ({"messages": [{"role": "user"}]}, 'message 0 needs a "role" and a "content"'),
    "lone surrogate": ('{"prompt": "w5 \\ud800"}', "the prompt is not valid Unicode text"),
    "id a float": ({"prompt": "w5", "id": 1.5}, '"id" must be a string or an integer, got a number'),
    "id a boolean": ({"prompt": "w5", "id": True}, '"id" must be a string or an integer, got a boolean'),
    "id null": ({"prompt": "w5", "id": None}, '"id" must be a string or an integer, got null'),
    "seed a string": ({"prompt": "w5", "seed": "3"}, '"seed" must be an integer'),
    "seed too big": ({"prompt": "w5", "seed": 2**64}, '"seed" must be an integer from -2**63 to 2**64 - 1'),
    "per-line setting": ({"prompt": "w5", "max_new_tokens": 3}, '"max_new_tokens" cannot be set per line'),
    "duplicate id": ({"prompt": "w6", "id": "a"}, 'duplicate id "a" (first on line 1)'),
    "id equal to a line number": ({"prompt": "w6", "id": 1}, "duplicate id 1 (first on line 1)"),
}


@pytest.mark.parametrize("case", BAD_LINES)
def test_bad_line_one_error_before_the_model_loads(folders, tmp_path, capfd, case):
    """The whole file is checked first: the model folder given does not exist, yet the error is the line's."""
    line, message = BAD_LINES[case]
    first = {"prompt": "w5", "id": "a"} if case != "id equal to a line number" else {"prompt": "w5"}
    src = write_lines(tmp_path / "in.jsonl", first, "", line if isinstance(line, str) else json.dumps(line),
                      {"prompt": "w7"})
    out = tmp_path / "out.jsonl"
    rc, stdout, err = run(capfd, ["generate", "--input", str(src), "--output", str(out),
                                  *model_args(folders, target=tmp_path / "no_model")])
    assert rc == 2 and stdout == ""
    assert err.count("\n") == 1 and err.startswith("error: input line 3: ") and message in err, err
    assert not out.exists()


BAD_RUNS = {
    "no prompt at all": ([], "give one prompt, or --input FILE"),
    "prompt and --input": (["w5", "--input", "{src}"], "not both"),
    "--output without --input": (["w5", "--output", "{out}"], "--output applies to --input"),
    "--batch-size 0": (["--input", "{src}", "--batch-size", "0"], "--batch-size must be at least 1"),
    "--json with --input": (["--input", "{src}", "--json"], "--json applies to one prompt"),
    "missing input": (["--input", "{tmp}/nothing.jsonl"], "input file not found"),
    "empty input": (["--input", "{tmp}/empty.jsonl"], "the input has no prompts"),
    "input not UTF-8": (["--input", "{tmp}/latin1.jsonl"], "input line 2: not UTF-8 text"),
    "output is the input": (["--input", "{src}", "--output", "{src}"], "is the --input file"),
    "output folder missing": (["--input", "{src}", "--output", "{tmp}/no/out.jsonl"], "cannot write output file"),
    "output of something else": (["--input", "{src}", "--output", "{tmp}/other.jsonl"],
                                 "other.jsonl was not written by fsd-eagle generate"),
    "output a folder": (["--input", "{src}", "--output", "{tmp}"], "is not a regular file"),
    "input a folder": (["--input", "{tmp}"], "is a folder, not a file"),
    "overwrite without input": (["w5", "--overwrite"], "--overwrite applies to --input"),
    "too long for the model": (["--input", "{tmp}/long.jsonl"], "input line 3: the prompt has 601 tokens"),
}


@pytest.mark.parametrize("case", BAD_RUNS)
def test_bad_run_one_error_line(folders, tmp_path, capfd, case):
    src = write_lines(tmp_path / "in.jsonl", {"prompt": "w5"})
    write_lines(tmp_path / "empty.jsonl", "", "  ")
    (tmp_path / "latin1.jsonl").write_bytes(b'{"prompt": "w5"}\n{"prompt": "caf\xe9"}\n')
    write_lines(tmp_path / "other.jsonl", {"id": 1, "text": "w5"}, {"question": "w5"})
    write_lines(tmp_path / "long.jsonl", {"prompt": "w5"}, "", {"prompt": " ".join(["w9"] * 600)})
    argv, message = BAD_RUNS[case]
    argv = [a.format(src=src, out=tmp_path / "out.jsonl", tmp=tmp_path) for a in argv]
    rc, stdout, err = run(capfd, ["generate", *argv, *model_args(folders)])
    assert rc == 2 and stdout == ""
    assert err.count("\n") == 1 and err.startswith("error: ") and message in err, err


def test_a_second_run_on_the_same_output_is_refused(folders, tmp_path, capfd):
    fcntl = pytest.importorskip("fcntl")
    src = write_lines(tmp_path / "in.jsonl", {"prompt": "w5"})
    out = tmp_path / "out.jsonl"
    with open(out, "ab") as f:
        fcntl.flock(f, fcntl.LOCK_EX)
        rc, _, err = run(capfd, ["generate", "--input", str(src), "--output", str(out), *model_args(folders)])
    assert rc == 2 and err == f"error: output file {out} is being written by another run\n"
    assert out.read_bytes() == b""


def test_files_are_replaced_whole(tmp_path, monkeypatch):
    """fsd_eagle.jsonl.write_text_atomic (result files, partial result files, settings): a write that fails
    leaves the old content and no temporary file; a good one replaces it."""
    import os

    from fsd_eagle.jsonl import write_text_atomic

    path = tmp_path / "sub" / "result.json"
    assert write_text_atomic(path, "old\n") == path and path.read_text() == "old\n"

    def broken_replace(src, dst):
        raise OSError("disk full")

    monkeypatch.setattr(os, "replace", broken_replace)
    with pytest.raises(OSError, match="disk full"):
        write_text_atomic(path, "new\n")
    monkeypatch.undo()
    assert path.read_text() == "old\n" and sorted(p.name for p in path.parent.iterdir()) == ["result.json"]
    write_text_atomic(path, "new\n")
    assert path.read_text() == "new\n"


# ---------------------------------------------------------------------------------- nothing lost


@pytest.mark.parametrize("content", [b'{"a": 1}', b'{"a": 1}\n', b"notes\nmore notes", b'{"id": 1, "text": "w5"}\n'],
                         ids=["json-no-newline", "json-line", "text", "old-results"])
@pytest.mark.parametrize("overwrite", [False, True])
def test_an_output_file_that_is_not_ours_is_never_changed(folders, tmp_path, capfd, content, overwrite):
    """A file that a run of ours did not write (no results header) is refused in one line and left byte for
    byte, before the model loads, with --overwrite too."""
    src = write_lines(tmp_path / "in.jsonl", {"prompt": "w5"})
    out = tmp_path / "notes.json"
    out.write_bytes(content)
    argv = ["generate", "--input", str(src), "--output", str(out), *model_args(folders, target=tmp_path / "no_model")]
    rc, _, err = run(capfd, argv + (["--overwrite"] if overwrite else []))
    assert rc == 2 and err.count("\n") == 1 and "was not written by fsd-eagle generate" in err, err
    assert out.read_bytes() == content


@pytest.mark.parametrize("change", ["input", "max_new_tokens", "temperature", "target", "inserted line"])
def test_a_rerun_of_another_run_on_the_same_output_is_refused_or_starts_afresh(folders, single, tmp_path, capfd,
                                                                               change):
    """The output's header holds the run's fingerprint: another input file, other settings or another model
    refuse to resume it (one line, nothing changed); --overwrite starts that file of ours afresh."""
    src = write_lines(tmp_path / "in.jsonl", *({"prompt": p} for p in PROMPTS[:3]))
    out = tmp_path / "out.jsonl"
    argv = ["generate", "--input", str(src), "--output", str(out), "--quiet", *model_args(folders)]
    assert run(capfd, argv)[0] == 0
    before = out.read_bytes()
    other = tmp_path / "target2"
    if change == "target":
        import shutil

        shutil.copytree(folders / "target", other)
    again = list(argv)
    if change == "input":
        again[again.index(str(src))] = str(write_lines(tmp_path / "in2.jsonl", {"prompt": PROMPTS[3]}))
    elif change == "inserted line":  # ids are line numbers: every prompt after it moves
        write_lines(src, {"prompt": PROMPTS[3]}, *({"prompt": p} for p in PROMPTS[:3]))
    elif change == "target":
        again[again.index(str(folders / "target"))] = str(other)
    else:
        again += ["--max-new-tokens", "5"] if change == "max_new_tokens" else ["--temperature", "0.5"]
    rc, _, err = run(capfd, again)
    assert rc == 2 and err.count("\n") == 1 and "holds the results of another run" in err, err
    assert out.read_bytes() == before
    rc, _, err = run(capfd, again + ["--overwrite"])
    assert rc == 0, err
    records = read_results(out)
    if change in ("input", "inserted line", "target"):
        prompts = [PROMPTS[3]] if change == "input" else PROMPTS[3:] + PROMPTS[:3] if change == "inserted line" \
            else PROMPTS[:3]
        assert sorted((r["id"], r["text"]) for r in records) == sorted(
            (i + 1, single[p]["text"]) for i, p in enumerate(prompts))


def test_input_from_a_pipe(folders, single, tmp_path, capfd):
    """--input <(...) and a FIFO are read once, as a file would be."""
    fifo = tmp_path / "prompts.fifo"
    os.mkfifo(fifo)
    lines = "".join(json.dumps({"id": i, "prompt": p}) + "\n" for i, p in enumerate(PROMPTS[:2]))
    import threading

    writer = threading.Thread(target=lambda: fifo.write_text(lines))
    writer.start()
    try:
        rc, stdout, err = run(capfd, ["generate", "--input", str(fifo), "--quiet", *model_args(folders)])
    finally:
        writer.join(30)
    assert rc == 0, err
    assert {r["id"]: r["text"] for r in map(json.loads, stdout.splitlines())} == {
        i: single[p]["text"] for i, p in enumerate(PROMPTS[:2])}

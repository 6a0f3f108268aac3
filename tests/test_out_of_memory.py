"""A device out of memory ends every command line with one readable line and its own exit status, and
nothing else is swallowed: torch's OutOfMemoryError is built here on the CPU, as CUDA raises it."""

from __future__ import annotations

import pytest
import torch

from fsd_eagle import cli
from fsd_eagle.errors import OUT_OF_MEMORY_STATUS, out_of_memory_line

TORCH_MESSAGE = ("CUDA out of memory. Tried to allocate 384.00 MiB. GPU 0 has a total capacity of 139.80 GiB of "
                 "which 185.62 MiB is free. Process 5148 has 17.15 GiB memory in use. Process 5142 has 17.13 GiB "
                 "memory in use. Of the allocated memory 23.52 GiB is allocated by PyTorch, with 7.16 GiB allocated "
                 "in private pools (e.g., CUDA Graphs).\nIf reserved but unallocated memory is large try setting "
                 "PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True")


def oom() -> torch.OutOfMemoryError:
    return torch.OutOfMemoryError(TORCH_MESSAGE)


def test_line_keeps_what_ran_out_and_drops_the_process_list():
    line = out_of_memory_line(oom(), "do less")
    assert line == ("out of device memory (CUDA out of memory. Tried to allocate 384.00 MiB. GPU 0 has a total "
                    "capacity of 139.80 GiB of which 185.62 MiB is free): do less")
    assert "\n" not in line and "Process" not in line


def test_other_errors_get_no_line():
    assert out_of_memory_line(RuntimeError("CUDA out of memory"), "x") is None  # not torch's error type
    assert out_of_memory_line(ValueError("x"), "x") is None
    short = out_of_memory_line(torch.OutOfMemoryError("out of memory. more"), "x")
    assert short == "out of device memory (out of memory): x"


def raise_oom(*args, **kwargs):
    raise oom()


def check_one_line(err: str, advice_word: str) -> None:
    lines = [x for x in err.splitlines() if x.strip()]
    assert len(lines) == 1, err
    assert lines[0].startswith("error: out of device memory (CUDA out of memory.") and advice_word in lines[0]
    assert "Traceback" not in err


def test_generate_cli(monkeypatch, capsys):
    monkeypatch.setattr(cli, "run_generate", raise_oom)
    assert cli.main(["generate", "hi"]) == OUT_OF_MEMORY_STATUS
    check_one_line(capsys.readouterr().err, "--batch-size")


def test_generate_cli_lets_other_runtime_errors_through(monkeypatch):
    def boom(*args):
        raise RuntimeError("not memory")

    monkeypatch.setattr(cli, "run_generate", boom)
    with pytest.raises(RuntimeError, match="not memory"):
        cli.main(["generate", "hi"])


def test_eval_commands(monkeypatch, capsys, tmp_path):
    import eval.__main__ as eval_main
    import eval.speed as speed

    monkeypatch.setattr(eval_main, "run_sweep_command", raise_oom)
    assert eval_main.main(["sweep", "--out", str(tmp_path / "s")]) == OUT_OF_MEMORY_STATUS
    check_one_line(capsys.readouterr().err, "rerun the same command")
    monkeypatch.setattr(speed, "main", raise_oom)  # speed parses its own options, outside the sweep's handler
    assert eval_main.main(["speed"]) == OUT_OF_MEMORY_STATUS
    check_one_line(capsys.readouterr().err, "--batch-size")


def test_training_commands(monkeypatch, capsys):
    import training.__main__ as training_main
    import training.cli as training_cli

    monkeypatch.setattr(training_cli, "main", raise_oom)
    assert training_main.main(["run", "recipe.json", "--out", "x"]) == OUT_OF_MEMORY_STATUS
    check_one_line(capsys.readouterr().err, "--resume")


CPU_MESSAGE = ("[enforce fail at alloc_cpu.cpp:127] err == 0. DefaultCPUAllocator: can't allocate memory: you tried to "
               "allocate 17179869184 bytes. Error code 12 (Cannot allocate memory)")


@pytest.mark.parametrize("error", [RuntimeError(CPU_MESSAGE), MemoryError()], ids=["cpu-allocator", "MemoryError"])
def test_the_cpu_running_out_of_memory_is_one_line_and_exit_3(monkeypatch, capsys, error):
    def raise_it(*args, **kwargs):
        raise error

    monkeypatch.setattr(cli, "run_generate", raise_it)
    assert cli.main(["generate", "hi"]) == OUT_OF_MEMORY_STATUS
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith("error: out of memory (") and "--batch-size" in err, err


def test_a_real_cpu_allocation_failure_is_recognised():
    """torch's own message when the CPU allocator fails, under an address-space limit in a child process."""
    import subprocess
    import sys

    code = ("import resource, torch\nfrom fsd_eagle.errors import out_of_memory_line\n"
            "resource.setrlimit(resource.RLIMIT_AS, (3 * 2**30, 3 * 2**30))\n"
            "try:\n    torch.empty(2**32)\nexcept RuntimeError as e:\n    print(out_of_memory_line(e, 'advice'))\n")
    pytest.importorskip("resource")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-500:]
    assert done.stdout.startswith("out of memory (DefaultCPUAllocator: can't allocate memory") and "advice" in done.stdout

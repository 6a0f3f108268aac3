"""Tensor-parallel targets (fsd_eagle.parallel): tiny random Llama and Qwen3 targets sharded over two CPU
processes by transformers' tensor parallelism (gloo) decode exactly what they decode unsharded (fp32,
greedy): plain decoding, EAGLE-2 with a random head, a draft model, and a batch of prompts; and sampled
with a seed, the same tokens as unsharded. Then the
one-line errors: a tp_size that does not divide the heads, a launch of another size, no torchrun, no NCCL.

The GPU version (NCCL, CUDA graphs, two GPUs) is eval/device/tp_check.py."""

from __future__ import annotations

import os
import queue as queue_module
import shutil
import socket
import sys
import time
import traceback
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).parent))
from test_api import make_tokenizer  # noqa: E402

from conftest import has_cpu_compiler, tiny_model  # noqa: E402

ARCHS = ("llama", "qwen3")
PROMPTS = (list(range(3, 20)), list(range(40, 49)))
NEW_TOKENS = 20
TREE = dict(total_tokens=12, depth=3, top_k=3)


def decode_all(folder: Path, head: Path, tp_size: int, device: str = "cpu") -> dict:
    """Tokens of every case on one target folder: AR, EAGLE-2 (``head``), the target drafting for itself
    (a draft model: long accepted paths), and both prompts decoded together (EAGLE-2)."""
    from fsd_eagle.api import SpeculativeGenerator
    from fsd_eagle.config import TreeConfig

    out = {}
    for name, kwargs in (("head", dict(head=head)), ("draft_model", dict(draft_model=folder))):
        gen = SpeculativeGenerator.load(folder, device=device, dtype="float32", tree=TreeConfig(**TREE),
                                        tp_size=tp_size, **kwargs)
        if name == "head":
            out["ar"] = gen.generate(PROMPTS[0], NEW_TOKENS, autoregressive=True, chat=False).token_ids
            out["batch"] = [r.token_ids for r in gen.generate([list(p) for p in PROMPTS], NEW_TOKENS, chat=False)]
        r = gen.generate(PROMPTS[0], NEW_TOKENS, chat=False)
        out[name] = r.token_ids
        out[f"{name}_tau"] = r.stats.tau
        # Sampling (recursive rejection with this seed's random stream): every rank draws the same numbers
        # and sees the same gathered logits, so it samples what the unsharded target samples (whose
        # distribution the chi-square tests check).
        out[f"{name}_sampled"] = gen.generate(PROMPTS[1], NEW_TOKENS, temperature=0.9, seed=3, chat=False).token_ids
        out[f"{name}_sampled_children"] = gen.generate(PROMPTS[1], NEW_TOKENS, temperature=0.9, seed=3, chat=False,
                                                       children="sampled").token_ids
    return out


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def decode_compiled(folder: Path, head: Path, tp_size: int) -> dict:
    """Greedy EAGLE-2 tokens through a compiled round and prefill (tests/test_sampling_modes.py's
    CompiledSession: the compiled code that GPU sessions capture, run on the CPU without graphs). One
    compiled round form only: what tensor parallelism changes (sharded projections, their sums, the
    gathered logits) is the target's forward, which every round form and the prefill trace alike, and each
    compilation costs minutes on a two-core machine (both ranks compile at once)."""
    import fsd_eagle.api as api
    from fsd_eagle.api import SpeculativeGenerator
    from fsd_eagle.config import TreeConfig
    from test_sampling_modes import CompiledSession

    api.Session = CompiledSession
    gen = SpeculativeGenerator.load(folder, head=head, device="cpu", dtype="float32", tree=TreeConfig(**TREE),
                                    tp_size=tp_size)
    return {"head": gen.generate(PROMPTS[0], NEW_TOKENS, chat=False).token_ids}


def _rank_main(rank: int, world: int, port: int, folders: dict, queue, env: dict | None = None,
               decode=decode_all) -> None:
    """One rank: every arch's cases (``decode``) with tp_size = world; (rank, results or the error) into
    ``queue``; the results also say how many sums fsd_eagle.tp_allreduce made (``allreduce_calls``)."""
    import torch.distributed as dist

    os.environ.update(RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(world), MASTER_ADDR="127.0.0.1",
                      MASTER_PORT=str(port), OMP_NUM_THREADS="1", **(env or {}))
    torch.set_num_threads(1)
    from fsd_eagle.cli import quiet_transformers

    quiet_transformers()
    try:
        from fsd_eagle import tp_allreduce

        results = {arch: decode(target, head, world) for arch, (target, head) in folders.items()}
        queue.put((rank, {**results, "allreduce_calls": tp_allreduce.calls}))
    except Exception:  # noqa: BLE001 (reported to the test, which fails with it)
        queue.put((rank, traceback.format_exc()))
    finally:
        if dist.is_initialized():
            dist.barrier()
            dist.destroy_process_group()


def run_ranks(world: int, folders: dict, timeout_s: float = 120.0, env: dict | None = None,
              decode=decode_all) -> dict[int, object]:
    """Start ``world`` CPU processes (spawned, gloo) running ``_rank_main`` (with ``env`` set, cases of
    ``decode``); their results by rank, up to the first rank that reports an error (its traceback, a
    string). Fails the test when a rank gives nothing within ``timeout_s``."""
    import torch.multiprocessing as mp

    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    port = _free_port()
    procs = [ctx.Process(target=_rank_main, args=(r, world, port, folders, queue, env, decode)) for r in range(world)]
    for p in procs:
        p.start()
    got: dict[int, object] = {}
    deadline = time.monotonic() + timeout_s
    try:
        while len(got) < world:
            try:
                rank, result = queue.get(timeout=max(1.0, deadline - time.monotonic()))
            except queue_module.Empty:
                missing = sorted(set(range(world)) - set(got))
                pytest.fail(f"ranks {missing} of {world} gave no result within {timeout_s:.0f} s")
            got[rank] = result
            if isinstance(result, str):  # a rank failed: the others may wait for it in a collective
                break
        return got
    finally:
        for p in procs:
            p.join(timeout=30)
            if p.is_alive():
                p.kill()


@pytest.fixture(scope="module")
def folders(tmp_path_factory) -> dict:
    """Per arch: a tiny random target folder (weights + tokenizer) and a random head folder for it."""
    from fsd_eagle.head import EagleHead, HeadConfig
    from fsd_eagle.models import save_head

    root = tmp_path_factory.mktemp("tp")
    out = {}
    for arch in ARCHS:
        model = tiny_model(arch, vocab_size=128)
        target, head = root / arch, root / f"{arch}-head"
        model.save_pretrained(target)
        make_tokenizer().save_pretrained(target)
        with torch.random.fork_rng():
            torch.manual_seed(1)
            save_head(EagleHead(HeadConfig.for_target(model.config)), head, dtype=torch.float32)
        out[arch] = (target, head)
    return out


def gloo_tensor_parallel() -> str | None:
    """Why tensor parallelism cannot run on this machine's CPU (None when it can)."""
    import torch.distributed as dist

    if not dist.is_available() or not dist.is_gloo_available():
        return "torch.distributed with gloo is not available"
    if torch.cuda.is_available():
        return "transformers shards onto the GPUs here (see eval/device/tp_check.py)"
    try:
        from transformers.distributed import DistributedConfig  # noqa: F401
    except ImportError:
        return "this transformers has no DistributedConfig"
    return None


@pytest.mark.skipif(gloo_tensor_parallel() is not None, reason=str(gloo_tensor_parallel()))
@pytest.mark.parametrize("allreduce", ["nccl", "symm"])
def test_two_ranks_decode_what_one_decodes(folders, allreduce):
    """Every case decodes the same tokens on two ranks as on one; with FSD_EAGLE_TP_ALLREDUCE=symm the
    row-parallel layers sum through fsd_eagle.tp_allreduce (on the CPU its torch.distributed path)."""
    from fsd_eagle.cli import quiet_transformers

    quiet_transformers()
    reference = {arch: decode_all(target, head, 1) for arch, (target, head) in folders.items()}
    ranks = run_ranks(2, folders, env={"FSD_EAGLE_TP_ALLREDUCE": allreduce})
    for rank, got in sorted(ranks.items()):
        assert isinstance(got, dict), f"rank {rank} failed:\n{got}"
        # two sums per decoder layer and target forward go through the op with symm, none without
        assert (got["allreduce_calls"] > 0) == (allreduce == "symm"), got["allreduce_calls"]
        assert isinstance(got, dict), f"rank {rank} failed:\n{got}"
        for arch in ARCHS:
            ref, tp = reference[arch], got[arch]
            for case in ("ar", "head", "draft_model", "batch", "head_sampled", "draft_model_sampled",
                         "head_sampled_children", "draft_model_sampled_children"):
                assert tp[case] == ref[case], f"{arch} {case} rank {rank}: {tp[case]} != {ref[case]}"
            assert len(ref["ar"]) == NEW_TOKENS
            assert tp["draft_model_tau"] == ref["draft_model_tau"] > 2  # long accepted paths were committed
            assert tp["head_tau"] == ref["head_tau"]


def count_collectives(folder: Path, head: Path, tp_size: int) -> dict:
    """Per case, the target forwards and the collectives (gloo all-reduces and all-gathers, from the
    profiler) of one decode: AR, EAGLE-2 over the whole vocabulary, EAGLE-2 with a draft vocabulary (the
    head gets a token ranking); and the model's decoder layers."""
    from torch.profiler import ProfilerActivity, profile

    from fsd_eagle.api import SpeculativeGenerator
    from fsd_eagle.config import TreeConfig
    from fsd_eagle.models import save_ranking

    ranked = Path(str(head) + f"-ranked-{os.environ['RANK']}")
    shutil.copytree(head, ranked, dirs_exist_ok=True)
    save_ranking(torch.arange(128), ranked)
    out = {}
    for name, folder_head, vocab in (("ar", head, 0), ("eagle2", head, 0), ("eagle2_vocab", ranked, 32)):
        gen = SpeculativeGenerator.load(folder, head=folder_head, device="cpu", dtype="float32", tp_size=tp_size,
                                        tree=TreeConfig(**TREE, draft_vocab=vocab))
        gen.generate(PROMPTS[0], 4, autoregressive=name == "ar", chat=False)  # warm-up
        with profile(activities=[ProfilerActivity.CPU]) as prof:
            r = gen.generate(PROMPTS[0], NEW_TOKENS, autoregressive=name == "ar", chat=False)
        names = [e.name for e in prof.events()]
        out[name] = {"forwards": r.stats.target_forwards, "all_reduce": names.count("gloo:all_reduce"),
                     "all_gather": names.count("gloo:all_gather")}
    out["layers"] = gen.engine.model.config.num_hidden_layers
    return out


@pytest.mark.skipif(gloo_tensor_parallel() is not None, reason=str(gloo_tensor_parallel()))
def test_collectives_per_forward(folders):
    """What a tensor-parallel round costs in collectives (fsd_eagle.parallel's docstring): each target
    forward (prefill included) two all-reduces per decoder layer plus at most one for a vocabulary-sharded
    embedding, and one all-gather of the logits; drafting over a draft vocabulary adds none, drafting over
    the whole vocabulary one all-gather per tree level."""
    ranks = run_ranks(2, {"llama": folders["llama"]}, decode=count_collectives)
    for rank, got in sorted(ranks.items()):
        assert isinstance(got, dict), f"rank {rank} failed:\n{got}"
        got = got["llama"]
        per_layer = 2 * got["layers"]
        for name in ("ar", "eagle2", "eagle2_vocab"):
            n = got[name]["forwards"]  # the prefill counts as one
            assert got[name]["all_reduce"] in (per_layer * n, (per_layer + 1) * n), (name, got)
        assert got["ar"]["all_gather"] == got["ar"]["forwards"]
        assert got["eagle2_vocab"]["all_gather"] == got["eagle2_vocab"]["forwards"]
        # over the whole vocabulary: the head's logits after the prefill's commit, then per round depth - 1
        # tree levels and the commit after verification
        drafted = got["eagle2"]["all_gather"] - got["eagle2"]["forwards"]
        assert drafted == 1 + (got["eagle2"]["forwards"] - 1) * TREE["depth"], got["eagle2"]


@pytest.mark.skipif(gloo_tensor_parallel() is not None, reason=str(gloo_tensor_parallel()))
@pytest.mark.skipif(not has_cpu_compiler(), reason="torch.compile on the CPU needs g++ and Python headers")
def test_two_ranks_compiled_rounds_decode_what_one_decodes(folders):
    """A compiled round and prefill of a target sharded over two ranks (dynamo traces the row-parallel sums)
    decode what the unsharded target decodes eagerly (greedy EAGLE-2); FSD_EAGLE_INDUCTOR_FREEZING=1 is set
    and must stay off in a tensor-parallel process (frozen, the process group would be a constant)."""
    from fsd_eagle.cli import quiet_transformers

    quiet_transformers()
    target, head = folders["llama"]
    reference = decode_all(target, head, 1)
    ranks = run_ranks(2, {"llama": folders["llama"]}, timeout_s=1200.0, env={"FSD_EAGLE_INDUCTOR_FREEZING": "1"},
                      decode=decode_compiled)
    for rank, got in sorted(ranks.items()):
        assert isinstance(got, dict), f"rank {rank} failed:\n{got}"
        assert got["llama"]["head"] == reference["head"], f"rank {rank}"


def test_freezing_is_off_in_a_tensor_parallel_process(monkeypatch):
    import torch.distributed as dist

    from fsd_eagle.decode import FREEZING_ENV, freezing

    monkeypatch.setenv(FREEZING_ENV, "1")
    assert freezing()
    monkeypatch.setattr(dist, "is_initialized", lambda: True)
    monkeypatch.setattr(dist, "get_world_size", lambda group=None: 2)
    assert not freezing()
    monkeypatch.setattr(dist, "get_world_size", lambda group=None: 1)
    assert freezing()


# ------------------------------------------------------------------------------------------ errors


def _launch_env(monkeypatch, world: int, rank: int = 0) -> None:
    monkeypatch.setenv("WORLD_SIZE", str(world))
    monkeypatch.setenv("RANK", str(rank))
    monkeypatch.setenv("LOCAL_RANK", str(rank))


def _no_launch_env(monkeypatch) -> None:
    for name in ("WORLD_SIZE", "RANK", "LOCAL_RANK"):
        monkeypatch.delenv(name, raising=False)


def test_tp_size_must_divide_heads(folders, monkeypatch):
    from fsd_eagle.api import SpeculativeGenerator
    from fsd_eagle.errors import ConfigError

    _launch_env(monkeypatch, 3)
    with pytest.raises(ConfigError, match="tp_size 3 does not divide the model's 4 attention heads"):
        SpeculativeGenerator.load(folders["llama"][0], device="cpu", tp_size=3)
    _launch_env(monkeypatch, 4)
    with pytest.raises(ConfigError, match="tp_size 4 does not divide the model's 2 key-value heads"):
        SpeculativeGenerator.load(folders["llama"][0], device="cpu", tp_size=4)


def test_launch_must_match_tp_size(folders, monkeypatch):
    from fsd_eagle.api import SpeculativeGenerator
    from fsd_eagle.errors import ConfigError

    _no_launch_env(monkeypatch)
    with pytest.raises(ConfigError, match="launch with torchrun --nproc-per-node 2"):
        SpeculativeGenerator.load(folders["llama"][0], device="cpu", tp_size=2)
    _launch_env(monkeypatch, 4)
    with pytest.raises(ConfigError, match="this launch has 4 processes .* but tp_size is 2"):
        SpeculativeGenerator.load(folders["llama"][0], device="cpu", tp_size=2)
    for bad in (0, -1, 1.5, True):
        with pytest.raises(ConfigError, match="tp_size must be an integer >= 1"):
            SpeculativeGenerator.load(folders["llama"][0], device="cpu", tp_size=bad)


def test_an_unknown_allreduce_mode_is_refused(monkeypatch):
    from fsd_eagle import tp_allreduce
    from fsd_eagle.errors import ConfigError

    monkeypatch.setenv(tp_allreduce.MODE_ENV, "fast")
    with pytest.raises(ConfigError, match="must be nccl or symm"):
        tp_allreduce.mode()
    monkeypatch.setenv(tp_allreduce.MODE_ENV, "SYMM")
    assert tp_allreduce.mode() == "symm"


def test_backend_without_nccl(monkeypatch):
    import torch.distributed as dist

    from fsd_eagle import parallel
    from fsd_eagle.errors import ConfigError

    monkeypatch.setattr(dist, "is_nccl_available", lambda: False)
    with pytest.raises(ConfigError, match="tensor parallelism on GPUs needs the NCCL backend"):
        parallel.check_backend("nccl")
    if not torch.cuda.is_available():
        with pytest.raises(ConfigError, match="CUDA is not available"):
            parallel.rank_device("cuda", 0)


def test_device_index_must_be_the_local_rank(monkeypatch):
    from fsd_eagle import parallel
    from fsd_eagle.errors import ConfigError

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    with pytest.raises(ConfigError, match="each process uses cuda:LOCAL_RANK"):
        parallel.rank_device("cuda:1", 0)
    with pytest.raises(ConfigError, match="use device cuda, not cpu"):
        parallel.rank_device("cpu", 0)


def test_cli_errors(folders, monkeypatch, capsys):
    from fsd_eagle.cli import main

    target = str(folders["llama"][0])
    _no_launch_env(monkeypatch)
    assert main(["generate", "hi", "--target", target, "--tp-size", "3", "--device", "cpu"]) == 2  # before any rank
    err = capsys.readouterr().err.strip().splitlines()
    assert err == ["error: tp_size 3 does not divide the model's 4 attention heads"], err
    _launch_env(monkeypatch, 2)
    assert main(["generate", "hi", "--target", target, "--tp-size", "3", "--device", "cpu"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err == ["error: this launch has 2 processes but --tp-size is 3: they must be equal"], err
    assert main(["generate", "--input", "-", "--target", target, "--device", "cpu"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "--input must be a file" in err[0], err


def test_unsharded_target_keeps_every_head(folders):
    from fsd_eagle.models import load_target
    from fsd_eagle.parallel import tp_size_of
    from fsd_eagle.target import Target

    model, _ = load_target(folders["qwen3"][0], torch.device("cpu"), torch.float32)
    assert tp_size_of(model) == 1 and Target(model).num_kv_heads == 2


@pytest.mark.skipif(torch.cuda.is_available() or not torch.distributed.is_gloo_available(),
                    reason="a CPU smoke run over gloo (on GPUs the script times NCCL and symmetric memory)")
def test_allreduce_bench_runs_over_gloo(tmp_path):
    """eval/device/allreduce_bench.py under torchrun with two CPU ranks: one row per message size, the
    matmul alone, with torch.distributed's all-reduce and with fsd_eagle.tp_allreduce's (its fallback here),
    and the all-reduce's share."""
    import json
    import shutil
    import subprocess

    root = Path(__file__).resolve().parents[1]
    torchrun = shutil.which("torchrun", path=str(Path(sys.executable).parent)) or shutil.which("torchrun")
    if torchrun is None:
        pytest.skip("torchrun is not installed")
    out = tmp_path / "allreduce.json"
    # --standalone: a rendezvous on a free local port (the default port 29500 may be taken on a shared host)
    r = subprocess.run([torchrun, "--standalone", "--nproc-per-node", "2", "eval/device/allreduce_bench.py",
                        "--out", str(out), "--rows", "1,4", "--k", "64", "--hidden", "32", "--reps", "4"],
                       cwd=root, capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stdout[-1500:] + r.stderr[:3000] + " ... " + r.stderr[-1500:]
    result = json.loads(out.read_text())
    assert result["world"] == 2 and not result["graphs"]
    assert [row["rows"] for row in result["rows"]] == [1, 4]
    for row in result["rows"]:
        assert row["k_per_rank"] == 32 and row["message_bytes"] == row["rows"] * 32 * 4
        assert row["dist_us"] > row["matmul_us"] > 0 and row["symm_us"] > row["matmul_us"]
        assert abs(row["dist_allreduce_us"] - (row["dist_us"] - row["matmul_us"])) < 0.02
        assert "no symmetric memory" in row["notes"]["symm"]  # the CPU sums with torch.distributed


def test_the_cli_starts_its_ranks_itself_without_torchrun(folders):
    """``fsd-eagle generate --tp-size 2`` outside torchrun starts two processes of itself (gloo on the CPU):
    the same tokens as one process, one JSON line on stdout (rank 0's), exit 0."""
    import json
    import subprocess

    target, head = (str(f) for f in folders["llama"][:2])
    base = [sys.executable, "-m", "fsd_eagle.cli", "generate", "hello there", "--target", target, "--head", head,
            "--device", "cpu",
            "--max-new-tokens", "12", "--json", "--no-chat"]
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK")}
    one = subprocess.run(base, capture_output=True, text=True, env=env, timeout=300)
    two = subprocess.run(base + ["--tp-size", "2"], capture_output=True, text=True, env=env, timeout=300)
    # All of stderr: when a rank fails the others' tracebacks (a closed connection) come last, and the
    # failed rank's cause before them.
    assert one.returncode == 0 and two.returncode == 0, (one.stderr[-4000:], two.stderr)
    lines = two.stdout.strip().splitlines()
    assert len(lines) == 1 and json.loads(lines[0])["text"] == json.loads(one.stdout)["text"]


def rank_program(body: str) -> list[str]:
    """A Python command that runs ``body`` with ``rank`` (its RANK) defined, as run_ranks' ranks."""
    return [sys.executable, "-c", f"import os, signal, sys, time\nrank = int(os.environ['RANK'])\n{body}"]


def test_the_launcher_names_the_rank_that_failed_and_its_exit_status(capfd):
    """A rank that fails is named on stderr with its exit status (one line), and the launch's exit status is
    that rank's when rank 0 succeeded; a launch whose ranks all succeed says nothing and exits 0."""
    from fsd_eagle.parallel import run_ranks

    assert run_ranks(rank_program("sys.exit(3 if rank == 1 else 0)"), 2, grace_s=5.0) == 3
    err = capfd.readouterr().err
    assert err.splitlines() == ["fsd-eagle: rank 1 of 2 ended with exit status 3"]
    assert run_ranks(rank_program("print(rank)"), 2) == 0
    out = capfd.readouterr()
    assert sorted(out.out.replace("\n", "")) == ["0", "1"] and out.err == ""  # the ranks' lines may interleave


def test_the_launcher_names_a_rank_killed_by_a_signal_and_stops_the_rank_waiting_for_it(capfd):
    """A rank killed by a signal (a crash leaves no traceback) is named with the signal; a rank that would
    wait forever for it (as in a collective) is stopped after the grace period and named as stopped, after
    the rank that failed; the launch exits as a shell reports the signal (128 + 11)."""
    from fsd_eagle.parallel import run_ranks

    body = "if rank == 1:\n    os.kill(os.getpid(), signal.SIGSEGV)\ntime.sleep(600)"
    start = time.monotonic()
    assert run_ranks(rank_program(body), 2, grace_s=1.0) == 128 + 11
    assert time.monotonic() - start < 60
    assert capfd.readouterr().err.splitlines() == ["fsd-eagle: rank 1 of 2 was killed by SIGSEGV",
                                                   "fsd-eagle: rank 0 of 2 was stopped after another rank failed"]


def test_the_launcher_reports_rank_0s_own_failure_first_when_both_fail(capfd, tmp_path):
    """When rank 0 fails by itself too, the launch has rank 0's exit status, and every failed rank is named,
    in the order they failed (rank 0 fails after rank 1 has ended: it waits for rank 1's file)."""
    from fsd_eagle.parallel import run_ranks

    flag = tmp_path / "rank1_ending"
    body = (f"if rank == 1:\n    open({str(flag)!r}, 'w').close()\n    sys.exit(6)\n"
            f"while not os.path.exists({str(flag)!r}):\n    time.sleep(0.01)\ntime.sleep(0.5)\nsys.exit(5)")
    assert run_ranks(rank_program(body), 2, grace_s=5.0) == 5
    assert capfd.readouterr().err.splitlines() == ["fsd-eagle: rank 1 of 2 ended with exit status 6",
                                                   "fsd-eagle: rank 0 of 2 ended with exit status 5"]

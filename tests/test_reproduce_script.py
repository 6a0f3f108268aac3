"""The reproduction driver (eval/device/reproduce_steps.sh, reproduce.sh): shell syntax, and a real run of its
CPU-only first stage: the stage is marked done, then skipped when the script runs again."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
SCRIPTS = ("eval/device/reproduce.sh", "eval/device/reproduce_steps.sh", "eval/device/head.sh",
           "eval/device/assemble.sh", "eval/device/batch.sh", "eval/device/job.sh", "eval/device/tp.sh",
           "eval/device/bring_back.sh", "eval/device/split_bundle.sh", "eval/device/serve.sh")


def test_scripts_parse():
    for script in SCRIPTS:
        subprocess.run(["bash", "-n", str(ROOT / script)], check=True)


def _run(tmp_path: Path, stages: str) -> subprocess.CompletedProcess:
    env = {**os.environ, "RES": str(tmp_path), "STAGES": stages, "ARITH": "5", "PY": sys.executable,
           "PYTHONPATH": str(ROOT)}
    return subprocess.run(["bash", "eval/device/reproduce_steps.sh"], cwd=ROOT, env=env, capture_output=True,
                          text=True, timeout=120)


def test_data_stage_runs_once_and_unknown_stages_are_refused(tmp_path):
    first = _run(tmp_path, "data")
    assert first.returncode == 0, first.stderr
    data = tmp_path / "data" / "finetune.jsonl.gz"
    assert data.is_file() and (tmp_path / "done" / "data").is_file()
    assert "wrote 7478 conversations" in (tmp_path / "logs" / "data.log").read_text()
    again = _run(tmp_path, "data")
    assert again.returncode == 0 and "stage data: done before" in again.stdout
    bad = _run(tmp_path, "nonsense")
    assert bad.returncode == 2 and "unknown stage nonsense" in bad.stderr
    assert _run(tmp_path, "wait:data").returncode == 0  # done: no wait
    env = {**os.environ, "RES": str(tmp_path), "STAGES": "wait:head", "WAIT_LIMIT": "0"}
    stuck = subprocess.run(["bash", "eval/device/reproduce_steps.sh"], cwd=ROOT, env=env, capture_output=True,
                           text=True, timeout=60)
    assert stuck.returncode == 3 and "gave up waiting for head after 0 s" in stuck.stderr


def test_run_stage_runs_its_command_line_once(tmp_path):
    """run:NAME runs the command line in RUN_NAME as a stage of its own (once; its output logged), and a
    run stage without its command line stops the script with the variable's name."""
    env = {**os.environ, "RES": str(tmp_path), "STAGES": "run:side1 run:side1",
           "RUN_side1": 'echo "$RES" >> "$RES/side/where"; echo logged'}
    first = subprocess.run(["bash", "eval/device/reproduce_steps.sh"], cwd=ROOT, env=env, capture_output=True,
                           text=True, timeout=60)
    assert first.returncode == 0, first.stderr
    assert (tmp_path / "side" / "where").read_text() == f"{tmp_path}\n"  # ran once
    assert "stage run-side1: done before" in first.stdout
    assert (tmp_path / "logs" / "run-side1.log").read_text() == "logged\n"
    missing = subprocess.run(["bash", "eval/device/reproduce_steps.sh"], cwd=ROOT,
                             env={**env, "STAGES": "run:other"}, capture_output=True, text=True, timeout=60)
    assert missing.returncode != 0 and "RUN_other" in missing.stderr
    assert not (tmp_path / "done" / "run-other").exists()


def test_seed_stage_copies_the_kept_sweeps_once(tmp_path):
    """seed: each sweep kept in $SEED (records, settings, run log) is copied into $RES, where a later sweep
    stage resumes it; a sweep that $RES has already is left alone."""
    seed = tmp_path / "kept"
    raw = seed / "sweep-draft-t0" / "raw" / "ar"
    raw.mkdir(parents=True)
    (raw / "gsm8k.jsonl.gz").write_bytes(b"records")
    for name in ("settings.json", "runs.jsonl"):
        (seed / "sweep-draft-t0" / name).write_text("{}")
    (seed / "sweep-head-t0").mkdir()  # no settings.json: not a sweep, skipped
    res = tmp_path / "res"
    env = {**os.environ, "RES": str(res), "STAGES": "seed", "SEED": str(seed), "PY": sys.executable}
    first = subprocess.run(["bash", "eval/device/reproduce_steps.sh"], cwd=ROOT, env=env, capture_output=True,
                           text=True, timeout=60)
    assert first.returncode == 0, first.stderr
    assert (res / "sweep-draft-t0" / "raw" / "ar" / "gsm8k.jsonl.gz").read_bytes() == b"records"
    assert (res / "sweep-draft-t0" / "settings.json").is_file() and not (res / "sweep-head-t0").exists()
    assert "seed sweep-draft-t0: 1 record files" in first.stdout
    (raw / "gsm8k.jsonl.gz").write_bytes(b"changed")
    again = subprocess.run(["bash", "eval/device/reproduce_steps.sh"], cwd=ROOT, env=env, capture_output=True,
                           text=True, timeout=60)
    assert again.returncode == 0 and "exists, kept" in again.stdout
    assert (res / "sweep-draft-t0" / "raw" / "ar" / "gsm8k.jsonl.gz").read_bytes() == b"records"


FAKE_PYTHON = r"""#!/usr/bin/env bash
# Stands in for python3 on the GPU host: records its arguments, writes what each stage leaves behind.
echo "$*" >> "$CALLS"
echo "${CUDA_VISIBLE_DEVICES:-all} $*" >> "$CALLS.gpu"
out=""; prev=""
for a in "$@"; do [ "$prev" = --out ] && out=$a; prev=$a; done
case "$*" in
  "-m training run"*"--stage distill"*)  # answers cached in the folder are kept, as --resume does
    [ -d "$out/distill-journal" ] && echo "journal found in $out" >> "$CALLS"
    if [ -n "${SLOW_DISTILL:-}" ] && [ ! -f "$out/distilled.jsonl.gz" ]; then  # stopped by a deadline (SIGINT)
      mkdir -p "$out/distill-journal"; echo batch > "$out/distill-journal/turn_1.jsonl"; exec sleep "$SLOW_DISTILL"
    fi
    [ -f "$out/distilled.jsonl.gz" ] || { echo answers > "$out/distilled.jsonl.gz"; echo '{}' > "$out/distilled.json"; } ;;
  "-m training run"*) [ -f "$out/distilled.jsonl.gz" ] || exit 3
    [ -d "$out/checkpoint" ] && echo "checkpoint found in $out" >> "$CALLS"
    mkdir -p "$out/checkpoint"
    case " $* " in *" --stop-after "*) exit 0 ;; esac  # stopped with a checkpoint before its last step
    mkdir -p "$out/head"; echo '{}' > "$out/head/config.json" ;;
  "-m eval tau"*) mkdir -p "$out"; echo '{"tau": {"all": 3.0}}' > "$out/tau.json" ;;
  "-m eval speed"*) mkdir -p "$(dirname "$out")"; echo '{"rows": []}' > "$out"
    case " $* " in *" --warm "*) mkdir -p "${out%.json}.warm"; echo "warm-up log" > "${out%.json}.warm/ar_t0.log" ;; esac ;;
  "-m eval sweep"*) mkdir -p "$out/raw"; sleep 1 ;;
  *) echo "default target at /nowhere" ;;
esac
"""


def run_host_script(tmp_path: Path, script: str, args: list[str], ended: str, scripts: tuple[str, ...] = (),
                    **settings: str) -> tuple[Path, Path]:
    """``eval/device/<script>`` as on a GPU host whose model is installed, with the stand-in python3, run twice
    (the second command must find the job ended, ``ended`` in its output); ``scripts``: other scripts of
    eval/device it runs. Returns the result folder ($RES) and the folder of what came back ($OUT) from the
    second command; the first command's is kept as ``tmp_path / "out1"``."""
    work, fake, res, out, store = (tmp_path / n for n in ("work", "bin", "res", "out", "store"))
    (work / "eval" / "device").mkdir(parents=True)
    for name in (script, "assemble.sh", "job.sh", *scripts):
        (work / "eval" / "device" / name).write_text((ROOT / "eval" / "device" / name).read_text())
    fake.mkdir()
    (fake / "python3").write_text(FAKE_PYTHON)
    (fake / "python3").chmod(0o755)
    # torchrun --standalone --nproc-per-node N -m ...: recorded, then the stand-in python3 runs the module
    (fake / "torchrun").write_text('#!/usr/bin/env bash\necho "$*" >> "$CALLS.torchrun"\nshift 3\nexec python3 "$@"\n')
    (fake / "torchrun").chmod(0o755)
    store.mkdir()
    (store / ".unpacked").touch()
    env = {**os.environ, "PATH": f"{fake}:{os.environ['PATH']}", "CALLS": str(tmp_path / "calls"),
           "RES": str(res), "STORE": str(store), "WAIT": "20", "PARTS": "1", "SHA": "0", **settings}
    for call in range(2):
        if call == 1:
            shutil.copytree(out, tmp_path / "out1")
        out.mkdir(exist_ok=True)
        for f in out.iterdir():
            f.unlink()
        r = subprocess.run(["bash", f"eval/device/{script}", *args], cwd=work, env={**env, "OUT": str(out)},
                           capture_output=True, text=True, timeout=60)
        assert r.returncode == 0, r.stderr
        assert ended in r.stdout
    return res, out


def test_head_script_distills_once_and_trains_the_arms_side_by_side(tmp_path):
    """eval/device/head.sh with a stand-in python3: one self-distillation, each arm trained in its own folder
    from a copy of the distilled answers with its own options, tau per arm, the speed benchmark on the first
    arm's head, the heads packed as soon as they are trained and sent once; a second command does not start the
    finished job again."""
    res, out = run_host_script(tmp_path, "head.sh", ["--unroll", "3"], "job ended, status 0",
                               ARMS="a=--arch eagle2;b=--arch eagle3 --layers 2 15 27", SPEED="--device cuda --limit 80",
                               TAU_TEMPERATURE="0.7", GPUS="2")
    calls = (tmp_path / "calls").read_text().splitlines()
    gpu_of = {c.split("--out ")[1].split()[0]: c.split()[0] for c in (tmp_path / "calls.gpu").read_text().splitlines()
              if "-m training run" in c and "--stage distill" not in c}
    assert gpu_of == {f"{res}/a": "0", f"{res}/b": "1"}  # GPUS=2: one arm per GPU
    training = [c for c in calls if c.startswith("-m training run")]
    assert len([c for c in training if "--stage distill" in c]) == 1
    arms = sorted(c for c in training if "--stage distill" not in c)
    assert len(arms) == 2 and all("--unroll 3" in c and "--time-budget 1500" in c for c in arms)
    assert f"--out {res}/a " in arms[0] and "--arch eagle2" in arms[0]
    assert f"--out {res}/b " in arms[1] and "--arch eagle3 --layers 2 15 27" in arms[1]
    taus = [c for c in calls if c.startswith("-m eval tau")]
    assert len(taus) == 4 and len([c for c in taus if "--temperature 0.7" in c]) == 2  # greedy and sampled, per arm
    assert [c for c in calls if c.startswith("-m eval speed")] == \
        [f"-m eval speed --device cuda --limit 80 --head {res}/a/head --out {res}/speed.json"]  # the first arm's
    assert sorted(f.name for f in out.iterdir()) == ["head.log", "speed.json", "tau_a.json",
                                                     "tau_a_sampled.json", "tau_b.json", "tau_b_sampled.json"]
    first = tmp_path / "out1"  # the distilled answers and the heads came back with the first command, once
    assert {"distilled.jsonl.gz", "distilled.jsonl.gz.json", "heads.tar"} <= {f.name for f in first.iterdir()}
    listing = subprocess.run(["tar", "-tf", str(first / "heads.tar")], capture_output=True, text=True).stdout
    assert "a/head/config.json" in listing and "b/head/config.json" in listing


def test_head_script_continues_arms_from_an_earlier_hosts_checkpoints(tmp_path):
    """RUNS_FROM: an arm whose checkpoint an earlier host left continues from it (copied into its run folder
    once, before its training resumes); an arm stopped with a checkpoint gets no tau and no speed run, and the
    job still ends with status 0, saying where its checkpoint is."""
    earlier = tmp_path / "earlier" / "a" / "checkpoint"
    earlier.mkdir(parents=True)
    (earlier / "progress.json").write_text('{"step": 500}')
    (earlier.parent / "run.json").write_text('{"recipe": {}}')
    res, out = run_host_script(tmp_path, "head.sh", [], "job ended, status 0", ARMS="b=--stop-after 5;a=",
                               RUNS_FROM=str(tmp_path / "earlier"), SPEED="--device cuda")
    calls = (tmp_path / "calls").read_text().splitlines()
    assert f"checkpoint found in {res}/a" in calls and f"checkpoint found in {res}/b" not in calls
    assert (res / "a" / "checkpoint" / "progress.json").read_text() == '{"step": 500}'
    assert (res / "a" / "run.json").read_text() == '{"recipe": {}}'  # the fingerprint a resume checks
    assert [c.split("--head ")[1].split()[0] for c in calls if c.startswith("-m eval tau")] == [f"{res}/a/head"]
    assert not any(c.startswith("-m eval speed") for c in calls)  # the first arm (b) has no head
    assert f"arm b stopped before its last step; its checkpoint: {res}/b/checkpoint" in (res / "log").read_text()
    assert sorted(f.name for f in out.iterdir()) == ["head.log", "progress_a.json", "tau_a.json"]


def test_head_script_seeds_the_distilled_answers_that_an_earlier_host_sent(tmp_path):
    """DISTILLED_FROM: the distilled answers (and their settings, <file>.json) that a first host sent back, as
    they came, seed the next host's self-distillation, which keeps them; every arm trains on a copy."""
    first, second = tmp_path / "first", tmp_path / "second"
    first.mkdir()
    run_host_script(first, "head.sh", [], "job ended, status 0")
    sent = first / "out1" / "distilled.jsonl.gz"
    sent.write_text("greedy before\n")
    res, _ = run_host_script(second, "head.sh", [], "job ended, status 0", ARMS="a=;b=",
                             DISTILLED_FROM=str(sent))
    assert (res / "distill" / "distilled.jsonl.gz").read_text() == "greedy before\n"  # kept, not made again
    assert (res / "distill" / "distilled.json").read_text() == (first / "out1" / "distilled.jsonl.gz.json").read_text()
    assert all((res / arm / "distilled.jsonl.gz").read_text() == "greedy before\n" for arm in ("a", "b"))


def test_head_script_adds_further_self_distillations_to_every_arm(tmp_path):
    """EXTRA_DISTILL: more self-distillations after the first (option sets separated by ';'), into $RES/extra,
    $RES/extra2, ... with their options last (they override the run's), whose answers every arm's training adds
    with --extra-distilled; they come back once (with their settings). EXTRA_FROM seeds those folders from an
    earlier host, by position, whose answers are kept (an empty entry: that one is made here)."""
    kept = tmp_path / "kept.jsonl.gz"
    kept.write_text("sampled before\n")
    kept.with_name("kept.jsonl.gz.json").write_text('{"distill_temperature": 0.7}')
    res, _ = run_host_script(tmp_path, "head.sh", ["--distill-turns", "3"], "job ended, status 0",
                             ARMS="a=;b=--unroll 2",
                             EXTRA_DISTILL="--distill-turns 1 --distill-temperature 0.7;--distill-temperature 1",
                             EXTRA_FROM=f"{kept};")
    training = [c for c in (tmp_path / "calls").read_text().splitlines() if c.startswith("-m training run")]
    distills = [c for c in training if "--stage distill" in c]
    assert len(distills) == 3 and f"--out {res}/distill " in distills[0] and "--distill-temperature" not in distills[0]
    assert f"--out {res}/extra " in distills[1] and f"--out {res}/extra2 " in distills[2]
    assert distills[1].endswith("--distill-turns 3 --distill-turns 1 --distill-temperature 0.7")
    assert distills[2].endswith("--distill-turns 3 --distill-temperature 1")
    arms = [c for c in training if "--stage distill" not in c]
    assert len(arms) == 2 and all(f"--extra-distilled {res}/extra/distilled.jsonl.gz "
                                  f"--extra-distilled {res}/extra2/distilled.jsonl.gz" in c for c in arms)
    assert (res / "extra" / "distilled.jsonl.gz").read_text() == "sampled before\n"  # seeded, not made again
    assert (res / "extra2" / "distilled.jsonl.gz").read_text() == "answers\n"  # made here
    first = tmp_path / "out1"
    assert (first / "extra_distilled.jsonl.gz").read_text() == "sampled before\n"
    assert (first / "extra_distilled.jsonl.gz.json").read_text() == '{"distill_temperature": 0.7}'
    assert (first / "extra2_distilled.jsonl.gz").read_text() == "answers\n"
    again = tmp_path / "out"  # the second command sends them no more
    assert not (again / "extra_distilled.jsonl.gz").exists() and not (again / "extra2_distilled.jsonl.gz").exists()


def test_head_script_warms_the_speed_run_beside_the_training(tmp_path):
    """WARM=3 with SPEED: the speed run's configurations compile at the start (eval speed --warm-only, the
    target's shipped head), then the speed run measures the trained head; a second command starts neither."""
    res, _ = run_host_script(tmp_path, "head.sh", [], "job ended, status 0", SPEED="--device cuda --backends compiled",
                             WARM="3")
    speed = [c for c in (tmp_path / "calls").read_text().splitlines() if c.startswith("-m eval speed")]
    assert speed == [f"-m eval speed --device cuda --backends compiled --warm 3 --warm-only --out {res}/warm/speed.json",
                     f"-m eval speed --device cuda --backends compiled --head {res}/head/head --out {res}/speed.json"]


def test_head_script_trains_arms_data_parallel_on_their_own_gpus(tmp_path):
    """NPROC=2 on four GPUs: the self-distillation is shared by all four (torchrun), then each arm's training
    goes through torchrun with two processes on its own pair of GPUs (arm a on 0-1, arm b on 2-3)."""
    res, _ = run_host_script(tmp_path, "head.sh", [], "job ended, status 0", NPROC="2", GPUS="4",
                             ARMS="a=--arch eagle2;b=--arch eagle3")
    launched = sorted(c for c in (tmp_path / "calls.torchrun").read_text().splitlines() if "--stage distill" not in c)
    assert len(launched) == 2 and all(c.startswith("--standalone --nproc-per-node 2 -m training run ")
                                      for c in launched)
    distilled = [c for c in (tmp_path / "calls.torchrun").read_text().splitlines() if "--stage distill" in c]
    assert len(distilled) == 1 and distilled[0].startswith("--standalone --nproc-per-node 4 ")  # every GPU
    gpus = {c.split("--out ")[1].split()[0]: c.split()[0] for c in (tmp_path / "calls.gpu").read_text().splitlines()
            if "-m training run" in c and "--stage distill" not in c}
    assert gpus == {f"{res}/a": "0,1", f"{res}/b": "2,3"}
    assert (res / "a" / "head" / "config.json").is_file() and (res / "b" / "head" / "config.json").is_file()


def test_batch_script_runs_several_speed_benchmarks_once_each(tmp_path):
    """eval/device/batch.sh with SPEED holding two option sets ("|"): two eval speed processes, one after
    the other, each with its own result file, neither run again by a second command; BATCH=0 runs no batched
    benchmark and KERNELS=0 keeps no kernels file."""
    res, out = run_host_script(tmp_path, "batch.sh", [], "benchmark ended, status 0", BATCH="0", KERNELS="0",
                               SPEED="--limit 80 --trees 64/6/8,96/6/12|--limit 80 --inductor-freezing")
    calls = (tmp_path / "calls").read_text().splitlines()
    assert [c for c in calls if c.startswith("-m eval")] == [
        f"-m eval speed --limit 80 --trees 64/6/8,96/6/12 --out {res}/gpu_speed_run.json",
        f"-m eval speed --limit 80 --inductor-freezing --out {res}/gpu_speed_run_2.json"]
    assert sorted(f.name for f in out.iterdir()) == ["batch.log", "gpu_speed_run.json", "gpu_speed_run_2.json"]
    assert not list(res.glob("kernels*"))


def test_batch_script_brings_back_the_speed_runs_warm_up_logs(tmp_path):
    """A speed run with --warm leaves each configuration's log in a folder beside its result file (where a
    compilation that failed says why): batch.sh sends those folders back as one archive."""
    import tarfile

    _, out = run_host_script(tmp_path, "batch.sh", [], "benchmark ended, status 0", BATCH="0", KERNELS="0",
                             SPEED="--limit 80 --warm 2")
    assert sorted(f.name for f in out.iterdir()) == ["batch.log", "gpu_speed_run.json", "warm_logs.tgz"]
    with tarfile.open(out / "warm_logs.tgz") as archive:
        log = archive.extractfile("gpu_speed_run.warm/ar_t0.log")
        assert log is not None and log.read() == b"warm-up log\n"


def test_batch_script_warms_each_method_once_before_the_benchmark(tmp_path):
    """WARM=ar,eagle2: one short benchmark per method with the run's options (its own method, 64 prompts, 8
    tokens, scratch result files), then the full benchmark; a second command runs none of them again."""
    res, _ = run_host_script(tmp_path, "batch.sh", ["--batch-sizes", "1,8"], "benchmark ended, status 0",
                             KERNELS="0", WARM="ar,eagle2")
    calls = [c for c in (tmp_path / "calls").read_text().splitlines() if c.startswith("-m eval")]
    common = "-m eval batch --device cuda --dtype bfloat16 --compile --batch-sizes 1,8"
    assert sorted(calls[:2]) == [f"{common} --methods {m} --limit 64 --max-new-tokens 8 --output {res}/warm-{m}.json"
                                 for m in ("ar", "eagle2")]
    assert calls[2:] == [f"-m eval batch --device cuda --dtype bfloat16 --compile --hf-limit 16 --resume --output "
                         f"{res}/gpu_batch.json --batch-sizes 1,8"]
    assert (res / "warmed").is_file()


def test_assemble_unpacks_carried_tars_and_checks_the_bundle(tmp_path):
    """eval/device/assemble.sh: pieces are collected until all have come, a carried tar (e.g. heads of an
    earlier host) is unpacked into the store as it comes, and a bundle whose checksum differs is refused."""
    import hashlib
    import tarfile

    work, store, src = tmp_path / "work", tmp_path / "store", tmp_path / "src"
    (work / "eval" / "device").mkdir(parents=True)
    (work / "eval" / "device" / "assemble.sh").write_text((ROOT / "eval" / "device" / "assemble.sh").read_text())
    src.mkdir()
    (src / "data.txt").write_text("bundle content\n")
    bundle = tmp_path / "bundle.tar"
    with tarfile.open(bundle, "w") as t:
        t.add(src / "data.txt", arcname="data.txt")
    raw = bundle.read_bytes()
    half = len(raw) // 2
    heads = tmp_path / "heads"
    (heads / "arm" / "head").mkdir(parents=True)
    (heads / "arm" / "head" / "config.json").write_text("{}")
    fake = tmp_path / "bin"
    fake.mkdir()
    (fake / "python3").write_text("#!/usr/bin/env bash\necho \"python3 $*\"\n")
    (fake / "python3").chmod(0o755)

    def command(piece: bytes | None, name: str, sha: str, with_heads: bool = False):
        carry = work / ".carry0"
        if carry.exists():
            subprocess.run(["rm", "-rf", str(carry)], check=True)
        carry.mkdir()
        if piece is not None:
            (carry / name).write_bytes(piece)
        if with_heads:
            with tarfile.open(carry / "heads.tar", "w") as t:
                t.add(heads / "arm", arcname="arm")
        env = {**os.environ, "PATH": f"{fake}:{os.environ['PATH']}", "STORE": str(store), "PARTS": "2", "SHA": sha}
        return subprocess.run(["bash", "eval/device/assemble.sh"], cwd=work, env=env, capture_output=True, text=True,
                              timeout=60)

    sha = hashlib.sha256(raw).hexdigest()
    r = command(raw[:half], "part_00", sha, with_heads=True)
    assert r.returncode == 0 and "pieces here: 1 of 2" in r.stdout, r.stderr
    assert (store / "arm" / "head" / "config.json").is_file() and not (store / ".unpacked").exists()
    r = command(raw[half:], "part_01", sha)
    assert r.returncode == 0, r.stderr
    assert (store / "data.txt").read_text() == "bundle content\n" and (store / ".unpacked").is_file()
    subprocess.run(["rm", "-rf", str(store)], check=True)  # a fresh host, a bundle with another checksum
    command(raw[:half], "part_00", "0" * 64)
    r = command(raw[half:], "part_01", "0" * 64)
    assert r.returncode != 0 and not (store / ".unpacked").exists()


def test_split_bundle_fits_each_piece_beside_the_working_tree(tmp_path):
    """eval/device/split_bundle.sh: pieces are at most LIMIT minus the travelling tree (tracked and untracked,
    not ignored files) minus MARGIN, land in ignored folders, rebuild the bundle, and come with PARTS and SHA;
    a tree too large for any piece, pieces already there and folders that git does not ignore are refused."""
    import hashlib

    repo = tmp_path / "repo"
    repo.mkdir()
    script = ROOT / "eval" / "device" / "split_bundle.sh"
    subprocess.run(["git", "init", "-q", str(repo)], check=True)
    (repo / ".gitignore").write_text("/.carry*/\n/big.bin\n")
    (repo / "tracked.txt").write_bytes(b"t" * 300_000)
    subprocess.run(["git", "-C", str(repo), "add", "tracked.txt", ".gitignore"], check=True)
    (repo / "untracked.txt").write_bytes(b"u" * 200_000)  # travels too
    (repo / "big.bin").write_bytes(b"i" * 5_000_000)       # ignored: does not travel
    tree = 300_000 + 200_000 + len((repo / ".gitignore").read_bytes())
    bundle = tmp_path / "bundle.tar"
    bundle.write_bytes(os.urandom(5_500_000))

    def split(limit: int, **env):
        return subprocess.run(["bash", str(script), str(bundle)], cwd=repo, capture_output=True, text=True,
                              timeout=60, env={**os.environ, "LIMIT": str(limit), "MARGIN": "100000", **env})

    limit = 3_000_000
    r = split(limit)
    assert r.returncode == 0, r.stderr
    pieces = sorted(repo.glob(".carry*/part_*"), key=lambda p: int(p.parent.name[len(".carry"):]))
    size = limit - tree - 100_000
    assert [p.parent.name for p in pieces] == [f".carry{i}" for i in range(len(pieces))]
    assert len(pieces) == -(-5_500_000 // size) and all(p.stat().st_size <= size for p in pieces)
    assert b"".join(p.read_bytes() for p in pieces) == bundle.read_bytes()
    sha = hashlib.sha256(bundle.read_bytes()).hexdigest()
    assert f"PARTS={len(pieces)} SHA={sha}" in r.stdout
    again = split(limit)  # the pieces of a bundle are never mixed with another's
    assert again.returncode != 0 and len(again.stderr.strip().splitlines()) == 1
    small = split(tree + 200_000, PREFIX=".carryb")
    assert small.returncode != 0 and "no room" in small.stderr and not list(repo.glob(".carryb*"))
    loose = split(limit, PREFIX="pieces")
    assert loose.returncode != 0 and "not git-ignored" in loose.stderr and not list(repo.glob("pieces*/part_*"))


def test_bring_back_sends_each_piece_once_and_the_pieces_rebuild_the_folder(tmp_path):
    """eval/device/bring_back.sh: the folder is packed and split once; each command returns the next PER_CALL
    pieces and the checksum, until "all pieces sent"; the pieces joined give the folder back, checksum and all."""
    import hashlib
    import tarfile

    src = tmp_path / "res" / "model"
    src.mkdir(parents=True)
    payload = os.urandom(5000)  # a tar of 10,240 bytes: five pieces of 2 KiB
    (src / "weights.bin").write_bytes(payload)
    got = tmp_path / "got"
    got.mkdir()
    env = {**os.environ, "NAME": "target", "FROM": str(tmp_path / "res"), "PATHS": "model", "PIECE": "2k",
           "PER_CALL": "2"}
    outputs = []
    for _ in range(4):
        out = tmp_path / "out"
        out.mkdir(exist_ok=True)
        for f in out.iterdir():
            f.unlink()
        r = subprocess.run(["bash", str(ROOT / "eval" / "device" / "bring_back.sh")], env={**env, "OUT": str(out)},
                           capture_output=True, text=True, timeout=60)
        assert r.returncode == 0, r.stderr
        outputs.append(r.stdout)
        pieces = sorted(f.name for f in out.iterdir() if ".part_" in f.name)
        assert len(pieces) <= 2 and (out / "target.tar.sha256").is_file()
        for name in pieces:
            assert not (got / name).exists()  # no piece comes twice
            (got / name).write_bytes((out / name).read_bytes())
        sha_line = (out / "target.tar.sha256").read_text()
    assert [("all pieces sent" in o) for o in outputs] == [False, False, True, True]
    assert "sent 0 pieces now" in outputs[3]
    joined = b"".join((got / n).read_bytes() for n in sorted(p.name for p in got.iterdir()))
    assert hashlib.sha256(joined).hexdigest() == sha_line.split()[0]
    (got / "all.tar").write_bytes(joined)
    with tarfile.open(got / "all.tar") as t:
        assert t.extractfile("model/weights.bin").read() == payload


def test_reproduce_script_runs_in_the_folder_its_bundle_was_unpacked_into(tmp_path):
    """eval/device/reproduce.sh with STORE = RES (a bundle of models unpacked straight into the results
    folder, docs/reproduction.md): the job starts there, runs the stages it is given and ends."""
    res = tmp_path / "res"
    res.mkdir()
    (res / ".unpacked").touch()
    got, _ = run_host_script(tmp_path, "reproduce.sh", [], "reproduction ended, status 0", ("reproduce_steps.sh",),
                             STORE=str(res), STAGES="data")
    assert got == res and (res / "done" / "data").is_file() and (res / "code" / "eval").is_dir()
    assert "-m training data prepare" in (tmp_path / "calls").read_text()
    assert "all -m training data prepare" in (tmp_path / "calls.gpu").read_text()  # every GPU visible


def test_lanes_run_stages_side_by_side_one_gpu_each(tmp_path):
    """reproduce.sh with LANES: each lane is its own background job on its own GPU, over the same $RES; a lane
    that waits for another's stage starts its next stage only once that stage is done; the table renders
    every sweep folder with its drafter's speed run; a second command finds both lanes ended and starts
    nothing again; settings given in a lane are that lane's."""
    res, out = run_host_script(tmp_path, "reproduce.sh", [], "lane b ended, status 0", ("reproduce_steps.sh",),
                               LANES="a 0 LIMIT=gsm8k=3,arith=2 data sweep:draft:0;\n  b 1 SPEED_TEMPS=0 "
                                     "wait:sweep-draft-t0 speed:draft table")
    calls = [c for c in (tmp_path / "calls.gpu").read_text().splitlines() if c.startswith(("0 ", "1 "))]
    assert (res / "lanes" / "a" / "rc").read_text().strip() == "0"
    by_gpu = {gpu: [c.split()[2] for c in calls if c.startswith(gpu + " ")] for gpu in ("0", "1")}
    assert by_gpu == {"0": ["training", "eval"], "1": ["eval", "eval"]}
    sweep = next(i for i, c in enumerate(calls) if "-m eval sweep" in c)
    speed = next(i for i, c in enumerate(calls) if "-m eval speed" in c)
    assert sweep < speed and f"--out {res}/sweep-draft-t0" in calls[sweep]
    assert "--limit gsm8k=3 arith=2 " in calls[sweep]  # each lane's own settings
    assert "--draft-model" in calls[speed] and "--temperatures 0 " in calls[speed]
    assert any(c.startswith(f"1 -m eval table --out {res}/sweep-draft-t0/") for c in calls)
    assert len(calls) == 4  # the second command started nothing
    assert (res / "sweep-draft-t0" / "speed.json").is_file()
    assert {p.name for p in (res / "lanes").iterdir()} == {"a", "b"}


def test_sharded_sweeps_run_their_processes_on_the_gpus_in_turn(tmp_path):
    """SHARDS=N: a sweep stage runs N `eval sweep --shard K/N` processes at once over one folder, on the GPUs
    of SWEEP_GPUS in turn, each marked done on its own, and the sweep is done when all are; a stage token's
    `sampled` draws the draft tokens (--children sampled) into a folder of its own; `speed:D:C` passes the
    children of the speed run's sampling rows; the table pairs both sweep folders with the drafter's speed."""
    res, _ = run_host_script(tmp_path, "reproduce.sh", [], "lane s ended, status 0", ("reproduce_steps.sh",),
                             LANES="s 1 SHARDS=3 SWEEP_GPUS=0,2 sweep:draft:0 sweep:draft:0.7:sampled "
                                   "speed:draft:sampled table")
    calls = (tmp_path / "calls.gpu").read_text().splitlines()
    sweeps = [c for c in calls if "-m eval sweep" in c]
    assert len(sweeps) == 6
    for name, children in (("sweep-draft-t0", "top"), ("sweep-draft-t0.7-sampled", "sampled")):
        mine = sorted(c for c in sweeps if c.endswith(f"--out {res}/{name}"))
        assert [c.split()[0] for c in mine] == sorted(["0", "2", "0"])
        assert sorted(c.split("--shard ")[1].split()[0] for c in mine) == ["0/3", "1/3", "2/3"]
        assert all(f"--children {children} " in c for c in mine)
        assert all((res / "done" / f"{name}.{k}-of-3").is_file() for k in range(3))
        assert (res / "done" / name).is_file() and (res / name / "speed.json").is_file()
    speed = next(c for c in calls if "-m eval speed" in c)
    assert speed.startswith("1 ") and "--children sampled " in speed
    assert sum("-m eval table" in c for c in calls) == 2


def test_batch_script_warms_on_another_gpu_beside_the_benchmark(tmp_path):
    """WARM=ar,eagle2 WARM_GPU=1: the warm-ups run on GPU 1 with the benchmark's batch sizes less 1 (batch 1
    the benchmark compiles first itself), the benchmark on the job's GPUs; neither runs again."""
    res, _ = run_host_script(tmp_path, "batch.sh", ["--batch-sizes", "1,8,32"], "benchmark ended, status 0",
                             KERNELS="0", WARM="ar,eagle2", WARM_GPU="1")
    calls = [c for c in (tmp_path / "calls.gpu").read_text().splitlines() if " -m eval" in c]
    common = "-m eval batch --device cuda --dtype bfloat16 --compile --batch-sizes 1,8,32 --batch-sizes 8,32"
    assert sorted(c for c in calls if "warm-" in c) == [
        f"1 {common} --methods {m} --limit 64 --max-new-tokens 8 --output {res}/warm-{m}.json" for m in ("ar", "eagle2")]
    assert [c for c in calls if "warm-" not in c] == [
        f"all -m eval batch --device cuda --dtype bfloat16 --compile --hf-limit 16 --resume --output "
        f"{res}/gpu_batch.json --batch-sizes 1,8,32"]
    assert (res / "warmed").is_file()


def test_head_script_keeps_to_the_gpus_it_is_given(tmp_path):
    """CUDA_VISIBLE_DEVICES=2,3 GPUS=2 (the host's other GPUs busy with another job): arm i trains on the i-th
    GPU of that list (2, then 3), and the self-distillation and the tau runs see the list itself."""
    res, _ = run_host_script(tmp_path, "head.sh", [], "job ended, status 0", GPUS="2", CUDA_VISIBLE_DEVICES="2,3",
                             ARMS="a=--arch eagle2;b=--arch eagle3")
    lines = (tmp_path / "calls.gpu").read_text().splitlines()
    gpus = {c.split("--out ")[1].split()[0]: c.split()[0] for c in lines
            if "-m training run" in c and "--stage distill" not in c}
    assert gpus == {f"{res}/a": "2", f"{res}/b": "3"}
    assert {c.split()[0] for c in lines if "-m eval tau" in c or "--stage distill" in c} == {"2,3"}


def test_batch_script_warms_the_default_batch_sizes_less_one(tmp_path):
    """Without --batch-sizes, WARM_GPU warm-ups take eval/batch.py's default batch sizes less 1 (the script
    keeps its own copy of the default: this is what keeps the two equal)."""
    from eval.batch import DEFAULT_BATCH_SIZES

    res, _ = run_host_script(tmp_path, "batch.sh", [], "benchmark ended, status 0", KERNELS="0", WARM="ar",
                             WARM_GPU="1")
    warm = [c for c in (tmp_path / "calls").read_text().splitlines() if "warm-ar" in c]
    expected = ",".join(s for s in DEFAULT_BATCH_SIZES.split(",") if s != "1")
    assert len(warm) == 1 and f"--batch-sizes {expected} --methods ar" in warm[0]


def test_head_script_shrinks_the_training_budget_to_a_deadline(tmp_path):
    """END_BY: the training's budget is what is left before the deadline less RESERVE, at least 60 s (a
    deadline already past gives 60 s); without END_BY the TIME_BUDGET stands."""
    run_host_script(tmp_path, "head.sh", [], "job ended, status 0", END_BY="1", TIME_BUDGET="900")
    arms = [c for c in (tmp_path / "calls").read_text().splitlines()
            if c.startswith("-m training run") and "--stage distill" not in c]
    assert len(arms) == 1 and "--time-budget 60 " in arms[0] + " "
    assert "training budget 60 s" in (tmp_path / "res" / "log").read_text()
    later = tmp_path / "later"
    later.mkdir()
    run_host_script(later, "head.sh", [], "job ended, status 0", END_BY=str(int(time.time()) + 10_000),
                    TIME_BUDGET="900", RESERVE="300")
    arms = [c for c in (later / "calls").read_text().splitlines()
            if c.startswith("-m training run") and "--stage distill" not in c]
    assert len(arms) == 1 and "--time-budget 900 " in arms[0] + " "  # the budget fits before the deadline


def test_a_self_distillation_stopped_at_the_deadline_continues_on_the_next_host(tmp_path):
    """CONTINUE=1: a self-distillation still running at the deadline less RESERVE is stopped (SIGINT, its
    journal kept), the job ends with status 124 and is not started again on that host; the next host, given
    the folder back (RUNS_FROM), continues that distillation from its journal and trains."""
    first = tmp_path / "first"
    first.mkdir()
    res, _ = run_host_script(first, "head.sh", [], "job ended, status 124", CONTINUE="1", RESERVE="100",
                             END_BY=str(int(time.time()) + 102), SLOW_DISTILL="60")
    assert "self-distillation stopped at the deadline" in (res / "log").read_text()
    assert (res / "distill" / "distill-journal" / "turn_1.jsonl").is_file()
    calls = (first / "calls").read_text().splitlines()
    assert len([c for c in calls if "--stage distill" in c]) == 1  # not started again after the deadline
    second = tmp_path / "second"
    second.mkdir()
    later, out = run_host_script(second, "head.sh", [], "job ended, status 0", RUNS_FROM=str(res))
    calls = (second / "calls").read_text().splitlines()
    assert f"journal found in {later}/distill" in calls
    assert (later / "head" / "head" / "config.json").is_file() and "tau_head.json" in {f.name for f in out.iterdir()}


def test_head_script_with_continue_stops_the_training_at_the_deadline_instead_of_shortening_it(tmp_path):
    """CONTINUE=1 with END_BY: each arm gets --stop-after (what is left before the deadline less RESERVE) and no
    --time-budget, so its run keeps its length and goes on on another host."""
    run_host_script(tmp_path, "head.sh", [], "job ended, status 0", END_BY=str(int(time.time()) + 1000),
                    RESERVE="100", TIME_BUDGET="0", CONTINUE="1")
    arms = [c for c in (tmp_path / "calls").read_text().splitlines()
            if c.startswith("-m training run") and "--stage distill" not in c]
    assert len(arms) == 1 and "--time-budget" not in arms[0]
    stop = int(arms[0].split("--stop-after ")[1].split()[0])
    assert 880 <= stop <= 900
    assert "training stops after" in (tmp_path / "res" / "log").read_text()


def test_code_copies_name_their_commit(tmp_path, monkeypatch):
    """A host's copy of the code has no git metadata: copy_code writes CODE into its COMMIT file (none without
    CODE), and eval/runinfo.git_commit reads it there, so that sweeps and benchmarks run from the copy record
    the commit they ran."""
    work = tmp_path / "work"
    (work / "eval" / "device").mkdir(parents=True)
    (work / "eval" / "device" / "job.sh").write_text((ROOT / "eval" / "device" / "job.sh").read_text())
    (work / "a.txt").write_text("x")
    script = 'source eval/device/job.sh; copy_code'
    for code, res in (("abc1234", tmp_path / "with"), ("", tmp_path / "without")):
        subprocess.run(["bash", "-c", script], cwd=work, check=True,
                       env={**os.environ, "RES": str(res), "CODE": code})
        assert (res / "code" / "a.txt").read_text() == "x"
    assert (tmp_path / "with" / "code" / "COMMIT").read_text() == "abc1234\n"
    assert not (tmp_path / "without" / "code" / "COMMIT").exists()

    sys.path.insert(0, str(ROOT))
    from eval import runinfo

    monkeypatch.setattr(runinfo, "ROOT", tmp_path / "with" / "code")  # not inside a git checkout
    assert runinfo.git_commit() == "abc1234"
    monkeypatch.setattr(runinfo, "ROOT", tmp_path / "without" / "code")
    assert runinfo.git_commit() is None
    monkeypatch.setattr(runinfo, "ROOT", ROOT)  # a checkout: git's answer
    if (ROOT / ".git").exists():
        assert runinfo.git_commit(short=True) == subprocess.run(
            ["git", "-C", str(ROOT), "rev-parse", "--short", "HEAD"], capture_output=True, text=True).stdout.strip()


def test_a_queued_job_waits_until_the_job_before_it_has_ended(tmp_path):
    """job.sh's wait_for_job (serve.sh's AFTER=): it returns once the earlier job's process is gone or its
    exit status is written, and not while that job runs."""
    before = tmp_path / "before"
    before.mkdir()
    script = f'''source eval/device/job.sh
sleep 2 > /dev/null & echo $! > "{before}/pid"
start=$SECONDS; wait_for_job "{before}"; echo "waited $((SECONDS - start))"
echo 0 > "{before}/rc"; sleep 30 > /dev/null & echo $! > "{before}/pid"
start=$SECONDS; wait_for_job "{before}"; echo "waited $((SECONDS - start))"; kill "$(cat "{before}/pid")"
'''
    r = subprocess.run(["bash", "-c", script], cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, r.stderr
    first, second = (int(line.split()[1]) for line in r.stdout.splitlines())
    assert first >= 1 and second == 0

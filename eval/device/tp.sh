#!/usr/bin/env bash
# The tensor-parallel check (eval/device/tp_check.py under torchrun) as one background process on a GPU host
# where each command's time is limited (docs/gpu-host.md), so that compiled tp rounds, whose compilation
# alone can take longer, finish. No model bundle is needed (random-weight targets). Run the same command
# line every time:
#   GPUS=2 CODE=<local commit> bash eval/device/tp.sh [tp_check options, e.g. --compile --skip-exact]
# The first command starts the run from a copy of the code under $RES/code (each command replaces the working
# tree); every command waits up to $WAIT seconds (default 540, or until the run ends) and copies the log and,
# once written, the result file (gpu_tp.json) to $OUT. A run that died is started again from the beginning.
set -euo pipefail
RES=${RES:-/root/tp}
WAIT=${WAIT:-540}
GPUS=${GPUS:-2}
mkdir -p "$RES"
source eval/device/job.sh
if needs_start; then
  copy_code
  # bash -c records its own pid (alive while the run goes on) and torchrun's exit status.
  (cd "$RES/code" && PYTHONPATH="$RES/code" setsid nohup bash -c 'echo $$ > "$0/pid";
      torchrun --nproc-per-node "$1" eval/device/tp_check.py --out "$0/gpu_tp.json" ${CODE:+--code "$CODE"} \
          "${@:2}" >> "$0/log" 2>&1; echo $? > "$0/rc"' "$RES" "$GPUS" "$@" > /dev/null 2>&1 &)
  sleep 2
fi
wait_job "tp check"
tail -n 25 "$RES/log" 2> /dev/null || true
if [ -n "${OUT:-}" ]; then
  cp "$RES/log" "$OUT/tp.log" 2> /dev/null || true
  cp "$RES/gpu_tp.json" "$OUT/" 2> /dev/null || true
fi

#!/usr/bin/env bash
# Gemma 3 270M's draft head end to end on a GPU host without network access, where each command runs at most
# 600 s and brings one piece of the Gemma bundle (see docs/gemma3.md). Run the same command line every time:
#   PARTS=9 SHA=<sha256 of the tar> GEMMA=1 CODE=<local commit> bash eval/device/gemma3_head.sh
# Each command moves its piece into place (eval/device/assemble.sh, which with GEMMA=1 converts Gemma 3 270M
# instead of the default model); once everything is installed, the first command starts the whole job as one
# background process (a copy of the code under $RES/code, since each command replaces the working tree):
# self-distillation, training with the time budget, export, then tau on MT-bench. Every command then waits up
# to $WAIT seconds (default 540, or until the job ends) and copies the log, the distilled answers, the training
# log, tau.json and, once exported, the head (model.safetensors and its small files) to $OUT. A job that died
# is restarted: every stage continues from what its run folder holds (distilled answers, checkpoint).
# DISTILLED_FROM=<file> seeds a fresh host with distilled answers brought back from an earlier one (it must
# travel with the tree, next to its distilled.json as <file>.json).
# Settings: RECIPE (training/recipes/gemma3-270m-eagle3.json), DATA (train_convs.jsonl.gz in the bundle),
# TIME_BUDGET (training seconds, default 1500), TAU_WORKERS (8); extra options for `python -m training run` follow.
set -euo pipefail
RES=${RES:-/root/res}
WAIT=${WAIT:-540}
STORE=${STORE:-/root/carry}
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH}
export FSD_EAGLE_CACHE=${FSD_EAGLE_CACHE:-/root/fsd-cache}
export GEMMA=${GEMMA:-1}
bash eval/device/assemble.sh
[ -f "$STORE/.unpacked" ] || exit 0  # more pieces to come
mkdir -p "$RES/run"
if [ -n "${DISTILLED_FROM:-}" ] && [ ! -f "$RES/run/distilled.jsonl.gz" ]; then
  cp "$DISTILLED_FROM" "$RES/run/distilled.jsonl.gz"
  cp "$DISTILLED_FROM.json" "$RES/run/distilled.json"
fi
source eval/device/job.sh
if needs_start; then
  copy_code
  # bash -c records its own pid (alive while the job goes on) and the exit status of the stage that ended it.
  (cd "$RES/code" && PYTHONPATH="$RES/code" RECIPE="${RECIPE:-training/recipes/gemma3-270m-eagle3.json}" \
      DATA="${DATA:-$STORE/train_convs.jsonl.gz}" TIME_BUDGET="${TIME_BUDGET:-1500}" TAU_WORKERS="${TAU_WORKERS:-8}" \
      setsid nohup bash -c 'echo $$ > "$0/pid"; set -o pipefail
      fail() { echo "$1" > "$0/rc"; exit "$1"; }
      target=$(python3 -m fsd_eagle.gemma3) || fail $?
      python3 -m training run "$RECIPE" --target "$target" --data "$DATA" --out "$0/run" --device cuda \
          --stage distill --resume --workers 14 "$@" >> "$0/log" 2>&1 || fail $?
      if [ ! -f "$0/run/head/config.json" ]; then
        python3 -m training run "$RECIPE" --target "$target" --data "$DATA" --out "$0/run" --device cuda \
            --resume --time-budget "$TIME_BUDGET" --workers 14 "$@" >> "$0/log" 2>&1 || fail $?
      fi
      python3 -m eval tau --questions mt_bench --target "$target" --head "$0/run/head" --device cuda \
          --dtype bfloat16 --workers "$TAU_WORKERS" --out "$0" >> "$0/log" 2>&1 || fail $?
      echo 0 > "$0/rc"' "$RES" "$@" > /dev/null 2>&1 &)
  sleep 2
fi
wait_job job
tail -n 25 "$RES/log" 2> /dev/null || true
if [ -n "${OUT:-}" ]; then
  cp "$RES/log" "$OUT/gemma3_head.log" 2> /dev/null || true
  cp "$RES/tau.json" "$OUT/" 2> /dev/null || true
  cp "$RES/run/distilled.jsonl.gz" "$RES/run/distilled.json" "$OUT/" 2> /dev/null || true
  if [ -f "$RES/run/head/config.json" ]; then
    tar -cf "$OUT/head.tar" -C "$RES/run" head
  elif [ -f "$RES/run/checkpoint/progress.json" ]; then
    cp "$RES/run/checkpoint/progress.json" "$OUT/"
  fi
fi

#!/usr/bin/env bash
# The whole reproduction (eval/device/reproduce_steps.sh: data -> fine-tune -> accuracy -> head -> draft
# model -> sweeps -> speed -> tables; docs/reproduction.md) on a GPU host without network access, where each
# command runs at most 600 s and brings one piece of the model bundle (docs/gpu-host.md). Run the same command
# line every time:
#   PARTS=3 SHA=<sha256 of the tar> bash eval/device/reproduce.sh
# Each command moves its piece into place (eval/device/assemble.sh); once the default model is installed, the
# first command starts the stages as one background process (from a copy of the code under $RES/code, since
# each command replaces the working tree), and every command then waits up to $WAIT seconds (default 540, or
# until the run ends) and copies the small results to $OUT: the stage log, every finished sweep's
# results.json / results.md / settings.json / runs.jsonl, the speed files, the fine-tuned model's and the
# draft model's recipe, training log and model card, and a tar of the sweeps' per-question records
# (reproduction_raw.tar.gz). A run that died is started again and its stages resume (finished ones are
# skipped). The stage settings (STAGES, LIMIT, TEMPS, ...) are those of reproduce_steps.sh, passed through.
set -euo pipefail
RES=${RES:-/root/repro}
WAIT=${WAIT:-540}
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH}
export FSD_EAGLE_CACHE=${FSD_EAGLE_CACHE:-/root/fsd-cache}
bash eval/device/assemble.sh
[ -f "${STORE:-/root/carry}/.unpacked" ] || exit 0  # more pieces to come
mkdir -p "$RES"
source eval/device/job.sh
if needs_start; then
  copy_code
  # bash -c records its own pid (alive while the stages run) and their exit status.
  (cd "$RES/code" && PYTHONPATH="$RES/code" RES="$RES" setsid nohup bash -c 'echo $$ > "$RES/pid";
      bash eval/device/reproduce_steps.sh >> "$RES/log" 2>&1; echo $? > "$RES/rc"' > /dev/null 2>&1 &)
  sleep 2
fi
wait_job reproduction
tail -n 20 "$RES/log" 2> /dev/null || true
for f in "$RES"/logs/*.log; do [ -f "$f" ] && echo "== $f" && tail -n 3 "$f"; done
if [ -n "${OUT:-}" ]; then
  (cd "$RES" && tar czf "$OUT/reproduction_small.tar.gz" --ignore-failed-read log logs done \
      sweep-*/results.json sweep-*/results.md sweep-*/settings.json sweep-*/runs.jsonl sweep-*/speed.json speed-*.json \
      accuracy/results.json accuracy/results.md finetune/model/recipe.json finetune/model/training.json \
      finetune/model/README.md draft/model/recipe.json draft/model/training.json draft/model/README.md \
      head/head/recipe.json head/head/training_log.json head/head/README.md 2> /dev/null || true)
  (cd "$RES" && tar czf "$OUT/reproduction_raw.tar.gz" --ignore-failed-read accuracy/raw sweep-*/raw \
      2> /dev/null || true)
fi

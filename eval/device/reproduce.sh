#!/usr/bin/env bash
# The whole reproduction (eval/device/reproduce_steps.sh: data -> fine-tune -> accuracy -> head -> draft
# model -> sweeps -> speed -> tables; docs/reproduction.md) on a GPU host without network access, where each
# command's time is limited and brings one piece of the model bundle (docs/gpu-host.md). Run the same command
# line every time:
#   PARTS=3 SHA=<sha256 of the tar> CODE=<local commit> bash eval/device/reproduce.sh
# (CODE: the commit the result files record; the host's copy of the code has no git metadata.)
# Each command moves its piece into place (eval/device/assemble.sh); once the default model is installed, the
# first command starts the stages as one background process (from a copy of the code under $RES/code, since
# each command replaces the working tree), and every command then waits up to $WAIT seconds (default 540, or
# until the run ends) and copies the small results to $OUT: the stage log, every finished sweep's
# results.json / results.md / settings.json / runs.jsonl, the speed files, the fine-tuned model's and the
# draft model's recipe, training log and model card, what run:NAME side jobs wrote under $RES/side, and one tar of per-question records per sweep
# (raw_<sweep folder>.tar.gz). A run that died is started again and its stages resume (finished ones are
# skipped). The stage settings (STAGES, LIMIT, TEMPS, ...) are those of reproduce_steps.sh, passed through.
# With several GPUs, LANES runs stage lists side by side, one background job and one GPU each, all on the same
# $RES: "NAME GPU [VAR=value ...] STAGE STAGE ...; NAME GPU ...", settings without spaces (LIMIT=gsm8k=1319,
# arith=400 written with a comma), e.g. on four GPUs
#   LANES="d0 0 wait:seed sweep:draft:0; d7 1 seed sweep:draft:0.7; h0 2 data head speed:head sweep:head:0;
#          h7 3 wait:head sweep:head:0.7"
# (stage names and wait:STAGE in reproduce_steps.sh). Each lane keeps its job in $RES/lanes/NAME (pid, rc,
# log, a copy of the code); a command waits until every lane has ended or $WAIT s have passed.
set -euo pipefail
RES=${RES:-/root/repro}
WAIT=${WAIT:-540}
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH}
export FSD_EAGLE_CACHE=${FSD_EAGLE_CACHE:-/root/fsd-cache}
bash eval/device/assemble.sh
[ -f "${STORE:-/root/carry}/.unpacked" ] || exit 0  # more pieces to come
mkdir -p "$RES"
source eval/device/job.sh
start() {  # start [GPU [VAR=value ...]]: the stages of this job (environment STAGES) from a copy of the code,
  copy_code  # in the background, on that GPU, with those settings
  local j gpu=${1:-}; j=$(job_dir)
  shift || true
  # bash -c records its own pid (alive while the stages run) and their exit status.
  (cd "$j/code" && if [ -n "$gpu" ]; then export CUDA_VISIBLE_DEVICES=$gpu; fi &&
      for a in "$@"; do export "$a"; done &&
      PYTHONPATH="$j/code" RES="$RES" JOB="$j" setsid nohup bash -c 'echo $$ > "$JOB/pid";
      bash eval/device/reproduce_steps.sh >> "$JOB/log" 2>&1; echo $? > "$JOB/rc"' > /dev/null 2>&1 &)
}
if [ -z "${LANES:-}" ]; then
  if needs_start; then start; sleep 2; fi
  wait_job reproduction
  tail -n 20 "$RES/log" 2> /dev/null || true
else
  names=()
  IFS=';' read -ra lanes <<< "${LANES//$'\n'/ }"  # lanes may be written on several lines
  for lane in "${lanes[@]}"; do
    read -r name gpu rest <<< "$lane"
    [ -n "${name:-}" ] || continue
    names+=("$name")
    settings=(); stages=""
    for word in $rest; do
      if [[ $word =~ ^[A-Z_]+= ]]; then settings+=("$word"); else stages="$stages${stages:+ }$word"; fi
    done
    mkdir -p "$RES/lanes/$name"
    if JOB=$RES/lanes/$name needs_start; then JOB=$RES/lanes/$name STAGES="$stages" start "$gpu" "${settings[@]}"; fi
  done
  sleep 2
  for _ in $(seq "$WAIT"); do
    alive=0
    for name in "${names[@]}"; do JOB=$RES/lanes/$name running && alive=1; done
    [ "$alive" = 0 ] && break
    sleep 1
  done
  for name in "${names[@]}"; do
    WAIT=0 JOB=$RES/lanes/$name wait_job "lane $name"
    tail -n 6 "$RES/lanes/$name/log" 2> /dev/null || true
  done
fi
for f in "$RES"/logs/*.log; do [ -f "$f" ] && echo "== $f" && tail -n 3 "$f"; done
if [ -n "${OUT:-}" ]; then
  (cd "$RES" && tar czf "$OUT/reproduction_small.tar.gz" --ignore-failed-read log lanes/*/log logs done \
      sweep-*/results.json sweep-*/results.md sweep-*/settings.json sweep-*/runs.jsonl sweep-*/speed.json speed-*.json \
      accuracy/results.json accuracy/results.md finetune/model/recipe.json finetune/model/training.json \
      finetune/model/README.md draft/model/recipe.json draft/model/training.json draft/model/README.md \
      head/head/recipe.json head/head/training_log.json head/head/README.md side 2> /dev/null || true)
  # the per-question records, one tar per sweep (each stays under the 16 MiB a returned file may have)
  for d in "$RES"/sweep-* "$RES"/accuracy; do
    if [ -d "$d/raw" ]; then (cd "$RES" && tar czf "$OUT/raw_$(basename "$d").tar.gz" "$(basename "$d")/raw" || true); fi
  done
fi

#!/usr/bin/env bash
# The reproduction of the FSD trade-off on a fine-tuned target, stage by stage (docs/reproduction.md): run it
# from a checkout on a GPU machine, `RES=/path bash eval/device/reproduce_steps.sh`, or let
# eval/device/reproduce.sh run it in the background on a GPU host without network access. Every stage writes
# under $RES and is resumable: a finished stage leaves $RES/done/<stage> and is skipped next time; an
# unfinished one continues from its checkpoint or its results (training --resume, the sweep's own resume).
# Stages (STAGES, in order; default: data finetune accuracy head draft sweep speed table):
#   data, finetune, accuracy, head, draft     one step each (docs/reproduction.md)
#   sweep[:D[:T[:sampled]]]  the accuracy sweeps of drafter D (head, or draft: the draft LM) at temperature T
#                   (with `sampled`: draft tokens drawn from the drafter, into sweep-D-tT-sampled); a bare
#                   `sweep` runs every DRAFTERS x TEMPS pair. With SHARDS=N, N processes share a sweep (on the
#                   GPUs of SWEEP_GPUS in turn, e.g. 0,2,3; default: this job's), each a stage of its own
#                   (sweep-D-tT.K-of-N), and the sweep is done when all are
#   speed[:D[:C]]   the single-process speed run of drafter D at every temperature of SPEED_TEMPS (C: the
#                   draft children of its sampling rows, top and/or sampled, e.g. top,sampled; default top)
#   table           renders every sweep folder in $RES with its drafter's speed run (speed-D.json)
#   seed            copies each sweep kept in $SEED (records, settings, run log) into $RES, unless $RES has that
#                   sweep already: a later sweep then runs only the questions those records lack (extending a
#                   LIMIT=400 sweep to all questions, on the same $RES so that the settings match)
#   wait:NAME       waits until the stage NAME (e.g. head, sweep-head-t0) is done, for stages that run side by
#                   side on several GPUs (eval/device/reproduce.sh, LANES); gives up after WAIT_LIMIT s (7200)
#   set:VAR=VALUE   sets a setting for the stages after it (e.g. set:SHARDS=8 set:SWEEP_GPUS=0,1,2,3)
#   run:NAME        runs the command line in the environment variable RUN_NAME once, as a stage of its own
#                   (run-NAME, logged to logs/run-NAME.log): a side job on the lane's GPU, e.g. a benchmark of
#                   the default model while the models train; files it writes under $RES/side come back
# Settings (environment): ARITH (generated training problems, 20000), LIMIT (questions per task in the sweeps;
# default all: 1,319 GSM8K + 1,000 arithmetic; per task: LIMIT="gsm8k=1319 arith=400"), TEMPS ("0 0.7"),
# SPEED_TEMPS (default TEMPS), DRAFTERS ("head draft"), BATCH (32), LAYERS (draft model layers, 4), HEAD_TIME
# (head training seconds, 900), DISTILL_COUNT (conversations the target answers for the head, 8000),
# SPEED_LIMIT (speed prompts, 40), BACKEND (speed rounds: graph, or compiled), THRESHOLDS (the sweep's
# --thresholds), SEED (eval/results/reproduction), TARGET (the fine-tuned target, $RES/finetune/model),
# SHARDS and SWEEP_GPUS (processes per sweep and their GPUs: see sweep above).
set -euo pipefail
RES=${RES:?set RES to the results folder}
STAGES=${STAGES:-data finetune accuracy head draft sweep speed table}
ARITH=${ARITH:-20000}
TEMPS=${TEMPS:-0 0.7}
SPEED_TEMPS=${SPEED_TEMPS:-$TEMPS}
WAIT_LIMIT=${WAIT_LIMIT:-7200}
DRAFTERS=${DRAFTERS:-head draft}
BATCH=${BATCH:-32}
LAYERS=${LAYERS:-4}
HEAD_TIME=${HEAD_TIME:-900}
DISTILL_COUNT=${DISTILL_COUNT:-8000}
SPEED_LIMIT=${SPEED_LIMIT:-40}
BACKEND=${BACKEND:-graph}
THRESHOLDS=${THRESHOLDS:-reverse_kl:0.25,0.5,1,2,3,4 kl:1,2,4 js:0.2,0.4}
SEED=${SEED:-eval/results/reproduction}
PY=${PY:-python3}
DATA=$RES/data/finetune.jsonl.gz
TARGET=${TARGET:-$RES/finetune/model}
mkdir -p "$RES/done" "$RES/logs"

stage() {  # stage NAME COMMAND...: run once, log to $RES/logs/NAME.log, mark done on success
  local name=$1; shift
  if [ -f "$RES/done/$name" ]; then echo "stage $name: done before"; return 0; fi
  echo "stage $name: $(date -u +%FT%TZ) $*" | tee -a "$RES/logs/stages.log"
  "$@" >> "$RES/logs/$name.log" 2>&1
  date -u +%FT%TZ > "$RES/done/$name"
  echo "stage $name: finished $(date -u +%FT%TZ)" | tee -a "$RES/logs/stages.log"
}

drafter_args() {  # the drafter and tree of a sweep or speed run: the EAGLE head, or the draft LM as a chain
  if [ "$1" = head ]; then
    echo "--head $RES/head/head --total-tokens 64 --depth 6 --tree-top-k 8"
  else
    echo "--draft-model $RES/draft/model --total-tokens 6 --depth 5 --tree-top-k 1"
  fi
}

fsd_pairs() {  # THRESHOLDS as the speed benchmark's divergence:threshold pairs
  local out="" item div t
  for item in $THRESHOLDS; do
    div=${item%%:*}
    for t in $(echo "${item#*:}" | tr ',' ' '); do out="$out${out:+,}$div:$t"; done
  done
  echo "$out"
}

limit_args() { if [ -n "${LIMIT:-}" ]; then echo "--limit ${LIMIT//,/ }"; fi; }  # "gsm8k=1319,arith=400" too

sweep_shard() {  # sweep_shard NAME DRAFTER TEMPERATURE CHILDREN [K/N]: one process of a sweep
  # shellcheck disable=SC2046,SC2086
  stage "$1${5:+.${5%/*}-of-${5#*/}}" $PY -m eval sweep --target "$TARGET" $(drafter_args "$2") \
      --tasks gsm8k arith --methods ar eagle2 fsd --divergences reverse_kl kl js --thresholds $THRESHOLDS \
      --temperature "$3" --children "$4" --batch-size "$BATCH" --no-progress $(limit_args) ${5:+--shard $5} \
      --out "$RES/$1"
}

sweep() {  # sweep DRAFTER TEMPERATURE [CHILDREN]: SHARDS processes at once, on the GPUs of SWEEP_GPUS in turn
  local children=${3:-top} name k gpus pids=() failed=0
  name="sweep-$1-t$2$([ "$children" = top ] || echo "-$children")"
  if [ -f "$RES/done/$name" ]; then echo "stage $name: done before"; return 0; fi
  if [ "${SHARDS:-1}" -le 1 ]; then sweep_shard "$name" "$1" "$2" "$children"; else
    read -ra gpus <<< "${SWEEP_GPUS:-${CUDA_VISIBLE_DEVICES:-0}}"  # "0 2 3" or 0,2,3
    read -ra gpus <<< "${gpus[*]//,/ }"
    for k in $(seq 0 $((SHARDS - 1))); do
      (export CUDA_VISIBLE_DEVICES=${gpus[$((k % ${#gpus[@]}))]}
       sweep_shard "$name" "$1" "$2" "$children" "$k/$SHARDS") &
      pids+=($!)
    done
    for k in "${pids[@]}"; do wait "$k" || failed=1; done
    [ "$failed" = 0 ] || { echo "stage $name: a shard failed" >&2; return 1; }
  fi
  date -u +%FT%TZ > "$RES/done/$name"
}

speed() {  # speed DRAFTER [CHILDREN]
  # shellcheck disable=SC2046
  stage "speed-$1" $PY -m eval speed --target "$TARGET" $(drafter_args "$1") --draft-vocab 0 \
      --prompts gsm8k --limit "$SPEED_LIMIT" --max-new-tokens 256 --repeats 1 --methods ar,eagle2,fsd \
      --fsd "$(fsd_pairs)" --temperatures "$(echo "$SPEED_TEMPS" | tr ' ' ',')" --children "${2:-top}" \
      --backends "$BACKEND" --rows-only --out "$RES/speed-$1.json"
}

seed() {  # copy the kept sweeps into $RES (see the header)
  local d name
  for d in "$SEED"/sweep-*/; do
    [ -f "$d/settings.json" ] || continue
    name=$(basename "$d")
    if [ -e "$RES/$name" ]; then echo "seed $name: $RES/$name exists, kept"; continue; fi
    mkdir -p "$RES/$name.seeding"
    cp -r "$d/raw" "$d/settings.json" "$d/runs.jsonl" "$RES/$name.seeding/"
    mv "$RES/$name.seeding" "$RES/$name"
    echo "seed $name: $(find "$RES/$name/raw" -name '*.jsonl*' | wc -l) record files from $d" | tee -a "$RES/logs/stages.log"
  done
  date -u +%FT%TZ > "$RES/done/seed"
}

await() {  # await STAGE: until $RES/done/STAGE exists
  local waited=0
  echo "waiting for $1: $(date -u +%FT%TZ)"
  until [ -f "$RES/done/$1" ]; do
    if [ "$waited" -ge "$WAIT_LIMIT" ]; then echo "gave up waiting for $1 after $WAIT_LIMIT s" >&2; exit 3; fi
    sleep 5; waited=$((waited + 5))
  done
}

table() {  # every sweep folder with its drafter's speed run
  local dir name d
  for dir in "$RES"/sweep-*-t*/; do
    name=$(basename "$dir"); d=${name#sweep-}; d=${d%-t*}
    [ -d "$dir/raw" ] && [ -f "$RES/speed-$d.json" ] || continue
    cp "$RES/speed-$d.json" "$dir/speed.json"
    $PY -m eval table --out "$dir" --no-plot >> "$RES/logs/table.log" 2>&1
  done
}

for s in $STAGES; do
  case $s in
    data) stage data $PY -m training data prepare --out "$DATA" --gsm8k --arith "$ARITH" --eval-prompts ;;
    finetune) stage finetune $PY -m training finetune training/recipes/smollm2-135m-gsm8k-finetune.json \
        --data "$DATA" --out "$RES/finetune" --device cuda --resume ;;
    accuracy) stage accuracy $PY -m eval sweep --target "$TARGET" --methods ar --tasks gsm8k arith \
        --batch-size 64 --no-progress $(limit_args) --out "$RES/accuracy" ;;
    head) stage head $PY -m training run training/recipes/smollm2-135m-instruct-continue.json --target "$TARGET" \
        --data "$DATA" --distill-count "$DISTILL_COUNT" --unroll 3 --time-budget "$HEAD_TIME" --out "$RES/head" \
        --device cuda --resume ;;
    draft) stage draft $PY -m training draft-model --target "$TARGET" --layers "$LAYERS" --data "$DATA" \
        --recipe training/recipes/smollm2-135m-draft-distill.json --out "$RES/draft" --device cuda --resume ;;
    seed) seed ;;
    sweep) for d in $DRAFTERS; do for t in $TEMPS; do sweep "$d" "$t"; done; done ;;
    sweep:*:*) IFS=: read -r _ d t c <<< "$s"; sweep "$d" "$t" "$c" ;;
    sweep:*) d=${s#sweep:}; for t in $TEMPS; do sweep "$d" "$t"; done ;;
    speed) for d in $DRAFTERS; do speed "$d"; done ;;
    speed:*) IFS=: read -r _ d c <<< "$s"; speed "$d" "$c" ;;
    table) table ;;
    wait:*) await "${s#wait:}" ;;
    set:[A-Z_]*=*) export "${s#set:}" ;;
    run:[A-Za-z0-9_]*) n=${s#run:}; v=RUN_$n; mkdir -p "$RES/side"
        stage "run-$n" bash -c "${!v:?the stage $s needs the command line in RUN_$n}" ;;
    *) echo "unknown stage $s" >&2; exit 2 ;;
  esac
done
echo "all stages done"

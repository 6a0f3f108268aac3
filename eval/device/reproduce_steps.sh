#!/usr/bin/env bash
# The reproduction of the FSD trade-off on a fine-tuned target, stage by stage (docs/reproduction.md): run it
# from a checkout on a GPU machine, `RES=/path bash eval/device/reproduce_steps.sh`, or let
# eval/device/reproduce.sh run it in the background on a GPU host without network access. Every stage writes
# under $RES and is resumable: a finished stage leaves $RES/done/<stage> and is skipped next time; an
# unfinished one continues from its checkpoint or its results (training --resume, the sweep's own resume).
# Settings (environment): STAGES (default: all, in order), ARITH (generated training problems, 20000),
# LIMIT (questions per task in the sweeps; default all: 1,319 GSM8K + 1,000 arithmetic), TEMPS ("0 0.7"),
# DRAFTERS ("head draft"), BATCH (32), LAYERS (draft model layers, 4), HEAD_TIME (head training seconds, 900),
# DISTILL_COUNT (conversations the target answers for the head, 8000), SPEED_LIMIT (speed prompts, 40),
# BACKEND (speed rounds: graph, or compiled), THRESHOLDS (the sweep's --thresholds), SEED (where the seed
# stage finds sweeps to continue: eval/results/reproduction). LIMIT may name tasks: LIMIT="gsm8k=1319 arith=400".
# The seed stage copies the records, settings and run log of each sweep kept in $SEED into $RES, unless $RES
# has that sweep already: a later sweep stage then runs only the questions those records lack (extending a
# LIMIT=400 sweep to all questions, on the same $RES so that the settings match).
set -euo pipefail
RES=${RES:?set RES to the results folder}
STAGES=${STAGES:-data finetune accuracy head draft sweep speed table}
ARITH=${ARITH:-20000}
TEMPS=${TEMPS:-0 0.7}
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
TARGET=$RES/finetune/model
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

limit_args() { if [ -n "${LIMIT:-}" ]; then echo "--limit $LIMIT"; fi; }

for s in $STAGES; do
  case $s in
    seed)
      for d in "$SEED"/sweep-*/; do
        [ -f "$d/settings.json" ] || continue
        name=$(basename "$d")
        if [ -e "$RES/$name" ]; then echo "seed $name: $RES/$name exists, kept"; continue; fi
        mkdir -p "$RES/$name"
        cp -r "$d/raw" "$d/settings.json" "$d/runs.jsonl" "$RES/$name/"
        echo "seed $name: $(find "$RES/$name/raw" -name '*.jsonl*' | wc -l) record files from $d" | tee -a "$RES/logs/stages.log"
      done ;;
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
    sweep)
      for d in $DRAFTERS; do
        for t in $TEMPS; do
          # shellcheck disable=SC2046,SC2086
          stage "sweep-$d-t$t" $PY -m eval sweep --target "$TARGET" $(drafter_args "$d") --tasks gsm8k arith \
              --methods ar eagle2 fsd --divergences reverse_kl kl js --thresholds $THRESHOLDS --temperature "$t" \
              --batch-size "$BATCH" --no-progress $(limit_args) --out "$RES/sweep-$d-t$t"
        done
      done ;;
    speed)
      for d in $DRAFTERS; do
        # shellcheck disable=SC2046
        stage "speed-$d" $PY -m eval speed --target "$TARGET" $(drafter_args "$d") --draft-vocab 0 \
            --prompts gsm8k --limit "$SPEED_LIMIT" --max-new-tokens 256 --repeats 1 --methods ar,eagle2,fsd \
            --fsd "$(fsd_pairs)" --temperatures "$(echo "$TEMPS" | tr ' ' ',')" --backends "$BACKEND" \
            --rows-only --out "$RES/speed-$d.json"
      done ;;
    table)
      for d in $DRAFTERS; do
        for t in $TEMPS; do
          if [ -d "$RES/sweep-$d-t$t/raw" ] && [ -f "$RES/speed-$d.json" ]; then
            cp "$RES/speed-$d.json" "$RES/sweep-$d-t$t/speed.json"
            $PY -m eval table --out "$RES/sweep-$d-t$t" --no-plot >> "$RES/logs/table.log" 2>&1
          fi
        done
      done ;;
    *) echo "unknown stage $s" >&2; exit 2 ;;
  esac
done
echo "all stages done"

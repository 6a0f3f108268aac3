#!/usr/bin/env bash
# Draft heads end to end on a GPU host without network access, where each command's time is limited and
# brings one piece of a model bundle (docs/gpu-host.md). Run the same command line every time:
#   PARTS=<pieces> SHA=<sha256 of the tar> CODE=<local commit> [GEMMA=1] [RECIPE=...] [ARMS=...] \
#       bash eval/device/head.sh [options for `python -m training run`]
# Each command moves its piece into place (eval/device/assemble.sh; GEMMA=1 converts Gemma 3 270M instead of the
# default model); once everything is installed, the first command starts the whole job as one background
# process (a copy of the code under $RES/code, since each command replaces the working tree):
# self-distillation once, then one training run per arm side by side on the same distilled answers, then tau on
# MT-bench for each arm's head. Every command waits up to $WAIT seconds (default 540, or until the job ends) and
# copies to $OUT the log, the distilled answers (once, to seed a new host with DISTILLED_FROM= / EXTRA_FROM=), each arm's
# checkpoint progress (progress_<arm>.json) and tau (tau_<arm>.json); and the trained heads as one tar (heads.tar,
# in 15 MiB pieces heads.tar.partNN when larger), each head once, as soon as it is trained (before tau and the
# speed run). A job that died is restarted: every stage continues from what its run folders hold (distilled answers, checkpoints, exported heads).
# Settings:
#   RECIPE      training recipe (default training/recipes/gemma3-270m-eagle3.json with GEMMA=1, else
#               training/recipes/smollm2-135m-instruct-eagle3.json, the shipped head's)
#   ARMS        heads trained side by side, "name=options;name=options" (options for `python -m training run`
#               for that arm alone), default one arm "head" with none. E.g. an architecture ablation:
#               ARMS="eagle2=--arch eagle2;eagle3=--arch eagle3 --layers 2 15 27 --draft-vocab-size 16384"
#   DATA        conversation file (default train_convs.jsonl.gz in the bundle)
#   TIME_BUDGET training seconds of each arm (default 1500; 0: none, the recipe's epochs or max_steps decide)
#   END_BY      a deadline (Unix seconds, e.g. $(( $(date +%s) + 1500 )) on the first command): when the training
#               starts, its budget shrinks to END_BY - now - RESERVE (default 300 s, for tau), at least 60 s, so
#               that a slow self-distillation cannot push the heads past the time the host is held. With
#               CONTINUE=1 the deadline instead stops each arm's training with a checkpoint (--stop-after; the
#               run keeps its length and schedule), and a self-distillation still running then (SIGINT: the
#               batches made are kept in its distill-journal), to go on on another host (RUNS_FROM below)
#   DISTILLED_FROM  distilled answers from an earlier host (travelling with the tree), as it sent them: the file
#               and its settings beside it as <file>.json (distilled.jsonl.gz and distilled.jsonl.gz.json)
#   EXTRA_DISTILL  options of more self-distillations after the first, separated by ';' (into $RES/extra,
#               $RES/extra2, ...), whose answers every arm adds with --extra-distilled: more answers of other
#               settings, e.g. the target's samples of the first turns at two temperatures,
#               EXTRA_DISTILL="--distill-turns 1 --distill-temperature 0.7;--distill-turns 1 --distill-temperature 1"
#   EXTRA_FROM  those self-distillations' answers from an earlier host (as DISTILLED_FROM), separated by ';' in
#               the same order (an empty entry: none for that one)
#   RUNS_FROM   a folder of run folders from an earlier host: distill/, extra/, ... (a self-distillation stopped
#               at the deadline continues from its journal) and <arm>/checkpoint with <arm>/run.json (that arm
#               continues from it, --resume), so that a run longer than one host's time goes on over several
#               hosts. An arm stopped before its last step (CONTINUE=1) gets no tau; bring the folders back with
#               bring_back.sh (PATHS="distill <arm>/checkpoint <arm>/run.json") and carry them in the next
#               bundle (docs/gpu-host.md): the resume is refused on other answers or data
#   TAU_TEMPERATURE  also measure each arm's tau sampled at this temperature (tau_<arm>_sampled.json), e.g. 0.7
#   TAU_WORKERS (8), WORKERS (tokenizer processes shared by the arms, 14)
#   GPUS        GPUs of the host (default: nvidia-smi's count); with more than one, the self-distillation is
#               shared by all of them (torchrun) and arm i trains alone on GPU i mod GPUS (on one GPU the arms
#               share it). A set CUDA_VISIBLE_DEVICES names the GPUs to use (GPU i is its i-th entry), so that
#               other jobs can have the host's other GPUs: CUDA_VISIBLE_DEVICES=2,3 GPUS=2
#   NPROC       train each arm data-parallel over NPROC GPUs (torchrun; README "several GPUs"): arm i on GPUs
#               i x NPROC ... (i + 1) x NPROC - 1 where the host has them (ARMS of 2 arms, NPROC=2 on 4 GPUs)
#   SPEED       options for `python -m eval speed`, run last on the first arm's head (--head and --out are
#               added; rows in speed.json, copied to $OUT), e.g. SPEED="--device cuda --dtype bfloat16 --limit 80
#               --repeats 1 --methods ar,eagle2 --temperatures 0,0.7 --backends compiled --rows-only"
#   WARM        with SPEED: compile the speed run's configurations at the start, WARM processes at a time, beside
#               the training (`eval speed --warm WARM --warm-only`, with the target's shipped head: the same
#               shapes as a head that continues it), so that the speed run at the end finds them compiled
#   RES         the job's folder (default /root/res): a job that ended with status 0 is not started again
#               there, so a second job on the same host (other ARMS) needs another folder, e.g. RES=/root/res2
set -euo pipefail
RES=${RES:-/root/res}
WAIT=${WAIT:-540}
STORE=${STORE:-/root/carry}
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH}
export FSD_EAGLE_CACHE=${FSD_EAGLE_CACHE:-/root/fsd-cache}
export GEMMA=${GEMMA:-0}
if [ "$GEMMA" = 1 ]; then RECIPE=${RECIPE:-training/recipes/gemma3-270m-eagle3.json}
else RECIPE=${RECIPE:-training/recipes/smollm2-135m-instruct-eagle3.json}; fi
ARMS=${ARMS:-head=}
IFS=';' read -r -a extra_sets <<< "${EXTRA_DISTILL:-}"
IFS=';' read -r -a extra_from <<< "${EXTRA_FROM:-}"
extras=()  # the folders of the further self-distillations: extra, extra2, ...
for i in "${!extra_sets[@]}"; do if [ "$i" = 0 ]; then extras+=(extra); else extras+=("extra$((i + 1))"); fi; done
bash eval/device/assemble.sh
[ -f "$STORE/.unpacked" ] || exit 0  # more pieces to come
seed() {  # seed FOLDER FILE: an earlier host's distilled answers (FILE, its settings FILE.json) into FOLDER
  mkdir -p "$1"
  if [ -n "$2" ] && [ ! -f "$1/distilled.jsonl.gz" ]; then
    cp "$2" "$1/distilled.jsonl.gz"
    cp "$2.json" "$1/distilled.json"
  fi
}
for stage in distill "${extras[@]}"; do  # self-distillations an earlier host stopped at its deadline, journal and all
  if [ -n "${RUNS_FROM:-}" ] && [ -d "$RUNS_FROM/$stage" ] && [ ! -f "$RES/$stage/distilled.json" ] &&
      [ ! -d "$RES/$stage/distill-journal" ]; then
    mkdir -p "$RES/$stage" && cp -r "$RUNS_FROM/$stage/." "$RES/$stage/"
    echo "$stage continues from $RUNS_FROM/$stage"
  fi
done
seed "$RES/distill" "${DISTILLED_FROM:-}"
for i in "${!extras[@]}"; do seed "$RES/${extras[$i]}" "${extra_from[$i]:-}"; done
IFS=';' read -r -a arms <<< "$ARMS"
names=()
for arm in "${arms[@]}"; do names+=("${arm%%=*}"); done
for name in "${names[@]}"; do  # checkpoints of an earlier host: those arms continue where it stopped
  if [ -n "${RUNS_FROM:-}" ] && [ -d "$RUNS_FROM/$name/checkpoint" ] && [ ! -d "$RES/$name/checkpoint" ]; then
    mkdir -p "$RES/$name" && cp -r "$RUNS_FROM/$name/checkpoint" "$RES/$name/"
    [ ! -f "$RUNS_FROM/$name/run.json" ] || cp "$RUNS_FROM/$name/run.json" "$RES/$name/"  # what the run was for
    echo "arm $name continues from $RUNS_FROM/$name/checkpoint"
  fi
done
source eval/device/job.sh
if needs_start && [ "$(cat "$RES/rc" 2> /dev/null)" != 124 ]; then  # (124: stopped at the deadline, CONTINUE=1)
  copy_code
  # bash -c records its own pid (alive while the job goes on) and the exit status of the stage that ended it.
  (cd "$RES/code" && PYTHONPATH="$RES/code" RECIPE="$RECIPE" ARMS="$ARMS" \
      DATA="${DATA:-$STORE/train_convs.jsonl.gz}" TIME_BUDGET="${TIME_BUDGET:-1500}" \
      TAU_WORKERS="${TAU_WORKERS:-8}" WORKERS="${WORKERS:-14}" SPEED="${SPEED:-}" TAU_TEMPERATURE="${TAU_TEMPERATURE:-}" \
      WARM="${WARM:-0}" END_BY="${END_BY:-}" RESERVE="${RESERVE:-300}" EXTRA_DISTILL="${EXTRA_DISTILL:-}" \
      EXTRAS="${extras[*]}" CONTINUE="${CONTINUE:-0}" \
      GPUS="${GPUS:-$(nvidia-smi -L 2> /dev/null | wc -l)}" NPROC="${NPROC:-1}" \
      setsid nohup bash -c 'echo $$ > "$0/pid"; set -o pipefail
      fail() { echo "$1" > "$0/rc"; exit "$1"; }
      target=()
      if [ "$GEMMA" = 1 ]; then target=(--target "$(python3 -m fsd_eagle.gemma3)") || fail $?; fi
      if [ -n "$SPEED" ] && [ "$WARM" -gt 0 ] && [ ! -f "$0/speed.json" ]; then  # compiled beside the training
        read -r -a speed <<< "$SPEED"
        python3 -m eval speed "${speed[@]}" "${target[@]}" --warm "$WARM" --warm-only --out "$0/warm/speed.json" \
            > "$0/log_warm" 2>&1 &
        warm_pid=$!
      fi
      distilled() {  # distilled FOLDER OPTIONS...: a self-distillation into FOLDER, with CONTINUE=1 stopped at
        # the deadline less RESERVE (SIGINT: the batches made stay in its journal for another host)
        local folder=$1 bound=() code=0 left
        shift
        if [ "$CONTINUE" = 1 ] && [ -n "$END_BY" ]; then
          left=$(( END_BY - $(date +%s) - RESERVE ))
          bound=(timeout --signal=INT --kill-after=60 $(( left > 1 ? left : 1 )))
        fi
        "${bound[@]}" "${distiller[@]}" run "$RECIPE" "${target[@]}" --data "$DATA" --out "$folder" --device cuda \
            --stage distill --resume --workers "$WORKERS" "$@" >> "$0/log" 2>&1 || code=$?
        if [ "$code" = 124 ]; then
          echo "self-distillation stopped at the deadline; its batches so far: $folder/distill-journal" >> "$0/log"
        fi
        return "$code"
      }
      distiller=(python3 -m training)  # with several GPUs the self-distillation is shared by all of them
      if [ "$GPUS" -gt 1 ]; then distiller=(torchrun --standalone --nproc-per-node "$GPUS" -m training); fi
      distilled "$0/distill" "$@" || fail $?
      extra=()  # further self-distillations (their options last, so that they override), added to every arm
      IFS=";" read -r -a extra_sets <<< "$EXTRA_DISTILL"
      read -r -a extras <<< "$EXTRAS"
      for i in "${!extra_sets[@]}"; do
        read -r -a extra_opts <<< "${extra_sets[$i]}"
        distilled "$0/${extras[$i]}" "$@" "${extra_opts[@]}" || fail $?
        extra+=(--extra-distilled "$0/${extras[$i]}/distilled.jsonl.gz")
      done
      if [ -n "$END_BY" ]; then  # what is left before the deadline, less the reserve, at least 60 s
        left=$(( END_BY - $(date +%s) - RESERVE )); left=$(( left > 60 ? left : 60 ))
        if [ "$CONTINUE" = 1 ]; then
          stop_after=$left
          echo "training stops after ${left} s with a checkpoint (deadline in $(( END_BY - $(date +%s) )) s)" >> "$0/log"
        else
          if [ "$TIME_BUDGET" = 0 ] || [ "$TIME_BUDGET" -gt "$left" ]; then TIME_BUDGET=$left; fi
          echo "training budget ${TIME_BUDGET} s (deadline in $(( END_BY - $(date +%s) )) s)" >> "$0/log"
        fi
      fi
      budget=()
      [ "$TIME_BUDGET" = 0 ] || budget=(--time-budget "$TIME_BUDGET")
      [ -z "${stop_after:-}" ] || budget+=(--stop-after "$stop_after")
      IFS=";" read -r -a arms <<< "$ARMS"
      workers=$(( WORKERS / ${#arms[@]} > 0 ? WORKERS / ${#arms[@]} : 1 ))
      pids=(); index=0
      outer=${CUDA_VISIBLE_DEVICES-unset}; IFS=, read -r -a visible <<< "${CUDA_VISIBLE_DEVICES:-}"
      devices() {  # devices FIRST COUNT: those GPUs, as entries of a set CUDA_VISIBLE_DEVICES where there is one
        local ids=() g
        for g in $(seq "$1" $(($1 + $2 - 1))); do ids+=("${visible[$g]:-$g}"); done
        (IFS=,; echo "${ids[*]}")
      }
      for arm in "${arms[@]}"; do
        name=${arm%%=*}; read -r -a opts <<< "${arm#*=}"
        # the GPUs of arm i: i mod GPUS alone, or with NPROC > 1 the i-th group of NPROC (when the host has them)
        first=$(( NPROC > 1 ? index * NPROC : (GPUS > 1 ? index % GPUS : 0) )); index=$((index + 1))
        group=$(devices "$first" "$NPROC")
        mkdir -p "$0/$name"
        [ -f "$0/$name/distilled.jsonl.gz" ] || cp "$0/distill/distilled.jsonl.gz" "$0/distill/distilled.json" "$0/$name/"
        [ -f "$0/$name/head/config.json" ] && continue
        if [ "$NPROC" -gt 1 ]; then  # data-parallel over NPROC GPUs
          trainer=(torchrun --standalone --nproc-per-node "$NPROC" -m training)
          if [ "$GPUS" -ge $((first + NPROC)) ]; then export CUDA_VISIBLE_DEVICES=$group; fi
        else  # with several GPUs, arm i trains alone on GPU i (mod the count)
          trainer=(python3 -m training)
          if [ "$GPUS" -gt 1 ]; then export CUDA_VISIBLE_DEVICES=$(devices "$first" 1); fi
        fi
        "${trainer[@]}" run "$RECIPE" "${target[@]}" --data "$DATA" --out "$0/$name" --device cuda --resume \
            "${budget[@]}" --workers "$workers" "${extra[@]}" "${opts[@]}" "$@" >> "$0/log_$name" 2>&1 &
        pids+=($!)
        if [ "$outer" = unset ]; then unset CUDA_VISIBLE_DEVICES; else export CUDA_VISIBLE_DEVICES=$outer; fi
      done
      for pid in "${pids[@]}"; do wait "$pid" || fail $?; done
      for arm in "${arms[@]}"; do
        name=${arm%%=*}
        if [ ! -f "$0/$name/head/config.json" ]; then  # stopped with a checkpoint: continued on another host
          echo "arm $name stopped before its last step; its checkpoint: $0/$name/checkpoint" >> "$0/log"
          continue
        fi
        [ -f "$0/$name/tau.json" ] || python3 -m eval tau --questions mt_bench "${target[@]}" --head "$0/$name/head" \
            --device cuda --dtype bfloat16 --workers "$TAU_WORKERS" --out "$0/$name" >> "$0/log" 2>&1 || fail $?
        if [ -n "$TAU_TEMPERATURE" ] && [ ! -f "$0/$name/sampled/tau.json" ]; then
          python3 -m eval tau --questions mt_bench "${target[@]}" --head "$0/$name/head" --device cuda \
              --dtype bfloat16 --workers "$TAU_WORKERS" --temperature "$TAU_TEMPERATURE" --out "$0/$name/sampled" \
              >> "$0/log" 2>&1 || fail $?
        fi
      done
      if [ -n "$SPEED" ] && [ ! -f "$0/speed.json" ] && [ -f "$0/${arms[0]%%=*}/head/config.json" ]; then
        [ -z "${warm_pid:-}" ] || wait "$warm_pid" || true  # the warm-ups end before the measuring starts
        read -r -a speed <<< "$SPEED"
        python3 -m eval speed "${speed[@]}" "${target[@]}" --head "$0/${arms[0]%%=*}/head" --out "$0/speed.json" \
            >> "$0/log" 2>&1 || fail $?
      fi
      echo 0 > "$0/rc"' "$RES" "$@" > /dev/null 2>&1 &)
  sleep 2
fi
wait_job job
for name in "${names[@]}"; do
  echo "== $name"; tail -n 4 "$RES/log_$name" 2> /dev/null || true
done
tail -n 12 "$RES/log" 2> /dev/null || true
if [ -n "${OUT:-}" ]; then
  cat "$RES/log" "$RES"/log_* > "$OUT/head.log" 2> /dev/null || true
  if [ -f "$RES/distill/distilled.json" ] && [ ! -f "$RES/distill/.sent" ]; then
    cp "$RES/distill/distilled.jsonl.gz" "$OUT/" && cp "$RES/distill/distilled.json" "$OUT/distilled.jsonl.gz.json" &&
        touch "$RES/distill/.sent"  # named as DISTILLED_FROM takes them
  fi
  for stage in "${extras[@]}"; do
    if [ -f "$RES/$stage/distilled.json" ] && [ ! -f "$RES/$stage/.sent" ]; then
      cp "$RES/$stage/distilled.jsonl.gz" "$OUT/${stage}_distilled.jsonl.gz" &&
          cp "$RES/$stage/distilled.json" "$OUT/${stage}_distilled.jsonl.gz.json" && touch "$RES/$stage/.sent"
    fi
  done
  cp "$RES/speed.json" "$OUT/" 2> /dev/null || cp "$RES/speed.partial.json" "$OUT/" 2> /dev/null || true
  for name in "${names[@]}"; do
    cp "$RES/$name/tau.json" "$OUT/tau_$name.json" 2> /dev/null || true
    cp "$RES/$name/sampled/tau.json" "$OUT/tau_${name}_sampled.json" 2> /dev/null || true
    cp "$RES/$name/checkpoint/progress.json" "$OUT/progress_$name.json" 2> /dev/null || true
  done
  heads=()  # trained heads not sent yet (a head folder appears whole: the trainer renames it into place)
  for name in "${names[@]}"; do
    [ -f "$RES/$name/head/config.json" ] && [ ! -f "$RES/$name/.head_sent" ] && heads+=("$name")
  done
  if [ "${#heads[@]}" -gt 0 ]; then
    tar -cf "$RES/heads.tar" -C "$RES" "${heads[@]/%//head}"
    if [ "$(stat -c %s "$RES/heads.tar")" -gt $((15 * 1048576)) ]; then
      split -b 15m -d "$RES/heads.tar" "$OUT/heads.tar.part"
    else
      cp "$RES/heads.tar" "$OUT/"
    fi
    for name in "${heads[@]}"; do touch "$RES/$name/.head_sent"; done
  fi
fi

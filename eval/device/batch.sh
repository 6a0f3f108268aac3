#!/usr/bin/env bash
# The batched-throughput benchmark (python -m eval batch) on a GPU host without network access, where each
# command's time is limited and brings one piece of the model bundle (see docs/gpu-host.md). Run the same
# command line every time:
#   PARTS=3 SHA=<sha256 of the tar> CODE=<local commit> bash eval/device/batch.sh [batch options]
# Each command moves its piece into place (eval/device/assemble.sh); once the model is installed, the first
# command starts the whole benchmark as one background process (a copy of the code under $RES/code, since each
# command replaces the working tree), and every command then waits up to $WAIT seconds (default 540, or until
# the run ends) and copies the partial result file and the log to $OUT. The result file is rewritten after
# every row; a run that died is restarted with --resume and keeps its finished rows. RESUME_FROM=<file> seeds
# a fresh host with a result file brought back from an earlier one (it must travel with the tree); PRESETS_FROM
# the same with a presets file of an interrupted tuner run.
# Default options: --device cuda --dtype bfloat16 --compile --hf-limit 16 (all batch sizes, methods, prompts);
# options given here are appended (a later option wins). TUNE=4,8,16,32,64 first runs the tree tuner for those
# batch buckets (python -m trees.tune --compile --resume into $RES/presets.json, each bucket written as it is
# measured and copied to $OUT by every command; the benchmark then uses it), once: a restarted run keeps the
# buckets already tuned. SPEED="<python -m eval speed options>" first runs that one-prompt benchmark (once; its
# rows in gpu_speed_run.json, and gpu_speed_run.partial.json as they come, copied to $OUT), in the same machine
# whose inductor cache the later steps then share; several option sets separated by "|" run one after the
# other as separate processes (gpu_speed_run.json, gpu_speed_run_2.json, ...: an A/B that one process cannot
# make, such as --inductor-freezing); BATCH=0 stops after them (and the tuner). KERNELS=0 keeps no kernels file.
# WARM=ar,eagle2,fsd first runs one short benchmark per method (64 prompts, 8 new tokens, the same batch sizes
# and options) side by side on the same GPU, once: compilation is mostly CPU work, so the methods' graphs
# compile in parallel into the host's inductor cache, and the full benchmark then finds them there (a
# compilation depends only on its configuration, not on what its process compiled before). With WARM_GPU=N
# (a second GPU) the warm-ups run on GPU N at the same time as the benchmark, at nice 10 and pinned to the
# cores of WARM_CPUS if given (e.g. 16-31; pin the benchmark with taskset around this script), and skip
# batch size 1, which the benchmark compiles first itself: the batched configurations are ready by the time it
# gets there (on two H200s the whole table, compilation included, then took 23 minutes).
set -euo pipefail
RES=${RES:-/root/res}
WAIT=${WAIT:-540}
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH}
export FSD_EAGLE_CACHE=${FSD_EAGLE_CACHE:-/root/fsd-cache}
# The batch sizes of the warm-ups that run beside the benchmark: the benchmark's (its --batch-sizes, or the
# default: eval/batch.py's DEFAULT_BATCH_SIZES, which a test keeps equal to this one), less 1.
sizes=1,4,8,16,32,64; prev=""
for a in "$@"; do
  if [ "$prev" = --batch-sizes ]; then sizes=$a; fi
  case $a in --batch-sizes=*) sizes=${a#*=} ;; esac
  prev=$a
done
WARM_SIZES=$(echo ",$sizes," | sed 's/,1,/,/g; s/^,//; s/,$//')
bash eval/device/assemble.sh
[ -f "${STORE:-/root/carry}/.unpacked" ] || exit 0  # more pieces to come
mkdir -p "$RES"
if [ -n "${RESUME_FROM:-}" ] && [ ! -f "$RES/gpu_batch.json" ]; then cp "$RESUME_FROM" "$RES/gpu_batch.json"; fi
if [ -n "${PRESETS_FROM:-}" ] && [ ! -f "$RES/presets.json" ]; then cp "$PRESETS_FROM" "$RES/presets.json"; fi
# Compiled kernels (fsd_eagle.compile_cache): kept in $RES/kernels.bin and copied to $OUT xz-compressed
# (kernels.bin.xz: a few hundred MB of kernels shrink 15-40x), so that KERNELS_FROM can seed the next fresh
# host of the same GPU type and versions with them: KERNELS_FROM="FILE [FILE ...]", a kernels.bin, or a
# kernels.bin.xz given whole or as pieces in order (joined, then decompressed).
if [ "${KERNELS:-1}" = 0 ]; then
  unset FSD_EAGLE_COMPILE_CACHE
else
  export FSD_EAGLE_COMPILE_CACHE=${FSD_EAGLE_COMPILE_CACHE:-$RES/kernels.bin}
fi
if [ -n "${KERNELS_FROM:-}" ] && [ -n "${FSD_EAGLE_COMPILE_CACHE:-}" ] && [ ! -f "$FSD_EAGLE_COMPILE_CACHE" ]; then
  # shellcheck disable=SC2086  # a list of files
  cat $KERNELS_FROM > "$FSD_EAGLE_COMPILE_CACHE.in"
  if xz -t "$FSD_EAGLE_COMPILE_CACHE.in" 2> /dev/null; then
    xz -dc "$FSD_EAGLE_COMPILE_CACHE.in" > "$FSD_EAGLE_COMPILE_CACHE" && rm "$FSD_EAGLE_COMPILE_CACHE.in"
  else
    mv "$FSD_EAGLE_COMPILE_CACHE.in" "$FSD_EAGLE_COMPILE_CACHE"
  fi
fi
source eval/device/job.sh
if needs_start; then
  copy_code
  if [ -f "$RES/presets.json" ]; then cp "$RES/presets.json" "$RES/code/fsd_eagle/presets.json"; fi
  # bash -c records its own pid (alive while the run goes on) and the exit status of the tuner or benchmark.
  (cd "$RES/code" && PYTHONPATH="$RES/code" TUNE="${TUNE:-}" SPEED="${SPEED:-}" BATCH="${BATCH:-1}" WARM="${WARM:-}" \
      WARM_GPU="${WARM_GPU:-}" WARM_CPUS="${WARM_CPUS:-}" WARM_SIZES="$WARM_SIZES" \
      setsid nohup bash -c 'echo $$ > "$0/pid";
      IFS="|" read -ra runs <<< "$SPEED"
      for i in "${!runs[@]}"; do
        name=gpu_speed_run$([ "$i" = 0 ] || echo "_$((i + 1))")
        [ -f "$0/$name.done" ] && continue
        python3 -m eval speed ${runs[$i]} ${CODE:+--code "$CODE"} --out "$0/$name.json" >> "$0/log" 2>&1 || { echo $? > "$0/rc"; exit; }
        rm -f "$0/$name.partial.json"; touch "$0/$name.done"
      done
      if [ -n "$TUNE" ] && [ ! -f "$0/tuned" ]; then
        [ -f "$0/presets.json" ] || cp fsd_eagle/presets.json "$0/presets.json"
        python3 -m trees.tune --device cuda --dtype bfloat16 --compile --batch-sizes "$TUNE" --resume \
            --out "$0/presets.json" >> "$0/log" 2>&1 || { echo $? > "$0/rc"; exit; }
        touch "$0/tuned"
      fi
      if [ -f "$0/presets.json" ]; then cp "$0/presets.json" fsd_eagle/presets.json; fi
      if [ "$BATCH" = 0 ]; then echo 0 > "$0/rc"; exit; fi
      if [ -n "$WARM" ] && [ ! -f "$0/warmed" ] && { [ -z "$WARM_GPU" ] || [ -n "$WARM_SIZES" ]; }; then
        where=(); sizes=()
        if [ -n "$WARM_GPU" ]; then  # beside the benchmark, on the other GPU
          where=(env CUDA_VISIBLE_DEVICES="$WARM_GPU" nice -n 10 ${WARM_CPUS:+taskset -c "$WARM_CPUS"})
          sizes=(--batch-sizes "$WARM_SIZES")
        fi
        for m in ${WARM//,/ }; do
          "${where[@]}" python3 -m eval batch --device cuda --dtype bfloat16 --compile "$@" "${sizes[@]}" --methods "$m" \
              --limit 64 --max-new-tokens 8 --output "$0/warm-$m.json" >> "$0/warm.log" 2>&1 &
        done
        if [ -z "$WARM_GPU" ]; then wait; fi
        touch "$0/warmed"
      fi
      python3 -m eval batch --device cuda --dtype bfloat16 --compile --hf-limit 16 --resume \
          --output "$0/gpu_batch.json" ${CODE:+--code "$CODE"} "$@" >> "$0/log" 2>&1; status=$?
      wait; echo $status > "$0/rc"' \
      "$RES" "$@" > /dev/null 2>&1 &)
  sleep 2
fi
wait_job benchmark
tail -n 25 "$RES/log" 2> /dev/null || true
if [ -n "${OUT:-}" ]; then
  cp "$RES/log" "$OUT/batch.log" 2> /dev/null || true
  cp "$RES/gpu_batch.json" "$RES/presets.json" "$RES"/gpu_speed_run*.json "$OUT/" 2> /dev/null || true
  # The speed runs' warm-up folders (each configuration's rows and log: a compilation that failed says why
  # there), as one file: what comes back is a few files.
  if compgen -G "$RES/gpu_speed_run*.warm" > /dev/null; then
    (cd "$RES" && tar czf "$OUT/warm_logs.tgz" gpu_speed_run*.warm) || true
  fi
  # Compressed once per change of the kernels file; pieces of 15 MiB where the whole would not come back.
  if [ -n "${FSD_EAGLE_COMPILE_CACHE:-}" ] && [ -f "$FSD_EAGLE_COMPILE_CACHE" ]; then
    if [ ! -f "$RES/kernels.bin.xz" ] || [ "$FSD_EAGLE_COMPILE_CACHE" -nt "$RES/kernels.bin.xz" ]; then
      xz -3 -T0 -c "$FSD_EAGLE_COMPILE_CACHE" > "$RES/kernels.bin.xz.tmp" && mv "$RES/kernels.bin.xz.tmp" "$RES/kernels.bin.xz"
    fi
    if [ "$(stat -c %s "$RES/kernels.bin.xz")" -le $((15 * 1024 * 1024)) ]; then
      cp "$RES/kernels.bin.xz" "$OUT/"
    else
      split -b 15m -d -a 1 "$RES/kernels.bin.xz" "$OUT/kernels.bin.xz.part"
    fi
  fi
fi

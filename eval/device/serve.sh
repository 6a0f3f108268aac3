#!/usr/bin/env bash
# The serving benchmark (python -m eval serve) on a GPU host without network access, where each command's time
# is limited and brings one piece of the model bundle (see docs/gpu-host.md; the bundle also holds the
# server's wheels: FastAPI, uvicorn, pydantic and, for transformers serve, openai). Run the same command line
# every time:
#   PARTS=4 SHA=<sha256 of the tar> CODE=<local commit> bash eval/device/serve.sh [eval serve options]
# Each command moves its piece into place (eval/device/assemble.sh); once everything is installed, the first
# command starts the benchmark as one background process (a copy of the code under $RES/code), and every
# command then waits up to $WAIT seconds (default 540, or until the run ends) and copies the result file
# (rewritten after every level) and the logs to $OUT. HF=0 leaves transformers serve out; HF_COMPILE=1 also
# measures it with --compile (with HF=0, that column alone beside ours). Two benchmarks queue one behind the
# other, each with its own RES folder: the second, with AFTER=<the first's RES>, starts only once the first has
# ended (give it WAIT=1 to return at once).
set -euo pipefail
RES=${RES:-/root/res}
WAIT=${WAIT:-540}
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH}
export FSD_EAGLE_CACHE=${FSD_EAGLE_CACHE:-/root/fsd-cache}
bash eval/device/assemble.sh
[ -f "${STORE:-/root/carry}/.unpacked" ] || exit 0  # more pieces to come
mkdir -p "$RES"
source eval/device/job.sh
if needs_start; then
  copy_code
  model=$(python3 -c "from fsd_eagle.models import default_target_path; print(default_target_path())")
  hf=()
  if [ "${HF:-1}" = 1 ] || [ "${HF_COMPILE:-0}" = 1 ]; then
    hf=(--hf-model "$model" --hf-command "{python} -m transformers.cli.transformers serve --continuous-batching --host 127.0.0.1 --port {port} $model")
    if [ "${HF:-1}" = 1 ]; then hf+=(--hf); fi
    if [ "${HF_COMPILE:-0}" = 1 ]; then hf+=(--hf-compile); fi
  fi
  (cd "$RES/code" && PYTHONPATH="$RES/code" AFTER="${AFTER:-}" setsid nohup bash -c 'echo $$ > "$0/pid";
      source eval/device/job.sh; if [ -n "$AFTER" ]; then echo "waiting for $AFTER" >> "$0/log"; wait_for_job "$AFTER"; fi
      python3 -m eval serve "${@}" --out "$0/gpu_serve.json" >> "$0/log" 2>&1; echo $? > "$0/rc"' \
      "$RES" "${hf[@]}" "$@" > /dev/null 2>&1 &)
  sleep 2
fi
wait_job "serving benchmark"
for f in gpu_serve.json log; do [ -f "$RES/$f" ] && cp "$RES/$f" "$OUT/"; done
if [ -d "$RES/gpu_serve.logs" ]; then tar -czf "$OUT/serve_logs.tgz" -C "$RES" gpu_serve.logs; fi
tail -5 "$RES/log" 2> /dev/null || true

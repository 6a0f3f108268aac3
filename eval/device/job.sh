# Sourced by the host scripts (batch.sh, reproduce.sh, head.sh): one background job that outlives each
# command, kept in the folder $JOB (default $RES). The job's shell writes its pid to $JOB/pid and its exit
# status to $JOB/rc. Several jobs side by side (reproduce.sh's LANES) each set JOB to their own folder.

job_dir() { echo "${JOB:-$RES}"; }

# Whether the job is alive.
running() { local j; j=$(job_dir); [ -f "$j/pid" ] && kill -0 "$(cat "$j/pid")" 2> /dev/null; }

# Whether to (re)start it: not running and not finished with status 0.
needs_start() { ! running && ! [ "$(cat "$(job_dir)/rc" 2> /dev/null)" = 0 ]; }

# A fresh copy of the code under $JOB/code (each command replaces the working tree), without the pieces.
# The copy has no git metadata: with CODE=<commit> it gets a COMMIT file, which eval/runinfo.git_commit reads
# in place of git, so that result files name the code they ran.
copy_code() {
  local j; j=$(job_dir)
  rm -rf "$j/code" "$j/rc"
  mkdir -p "$j/code"
  tar --exclude=./.git --exclude='./.carry*' -cf - . | tar -xf - -C "$j/code"
  if [ -n "${CODE:-}" ]; then echo "$CODE" > "$j/code/COMMIT"; fi
}

# Wait up to $WAIT seconds for the job to end, then say how it stands ($1: what to call it).
wait_job() {
  local j; j=$(job_dir)
  for _ in $(seq "$WAIT"); do running || break; sleep 1; done
  if running; then
    echo "$1 running (pid $(cat "$j/pid"))"
  else
    echo "$1 ended, status $(cat "$j/rc" 2> /dev/null || echo unknown)"
  fi
}

# Wait until the job in folder $1 has ended (its rc written, or its process gone): a run queued behind
# another must not share the GPU with it.
wait_for_job() {
  while [ ! -f "$1/rc" ] && JOB=$1 running; do sleep 5; done
}

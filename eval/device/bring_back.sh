#!/usr/bin/env bash
# Bring folders of a GPU host back in pieces, where what a command may return is limited in
# size (docs/gpu-host.md). Run the same line until it prints "all pieces sent":
#   NAME=target FROM=/root/repro PATHS="finetune/model" bash eval/device/bring_back.sh
# The first command packs PATHS (relative to FROM) into one tar, records its sha256 and splits it into 16 MiB
# pieces (PIECE) under $FROM/back/$NAME; every command copies the next PER_CALL pieces (default 3: with the
# sha256 file they stay under 64 MiB) and the sha256 file to $OUT. Locally, once every piece has come:
#   cat NAME.tar.part_* > NAME.tar && sha256sum -c NAME.tar.sha256
set -euo pipefail
NAME=${NAME:?name of the bundle}
FROM=${FROM:?folder that PATHS are relative to}
PATHS=${PATHS:?folders or files to bring back}
PER_CALL=${PER_CALL:-3}
PIECE=${PIECE:-16m}
DIR=$FROM/back/$NAME
if [ ! -f "$DIR/.split" ]; then
  rm -rf "$DIR" && mkdir -p "$DIR"
  # shellcheck disable=SC2086  # a list of paths
  tar cf "$DIR/$NAME.tar" -C "$FROM" $PATHS
  (cd "$DIR" && sha256sum "$NAME.tar" > "$NAME.tar.sha256")
  split -b "$PIECE" -d -a 2 "$DIR/$NAME.tar" "$DIR/$NAME.tar.part_"
  rm "$DIR/$NAME.tar"
  touch "$DIR/.split"
fi
mkdir -p "$DIR/sent"
sent=0
for piece in "$DIR/$NAME".tar.part_*; do
  base=$(basename "$piece")
  [ -f "$DIR/sent/$base" ] && continue
  [ "$sent" -ge "$PER_CALL" ] && break
  cp "$piece" "$OUT/" && touch "$DIR/sent/$base"
  sent=$((sent + 1))
done
cp "$DIR/$NAME.tar.sha256" "$OUT/"
left=$(comm -23 <(cd "$DIR" && ls "$NAME".tar.part_* | sort) <(ls "$DIR/sent" | sort) | wc -l)
echo "$NAME: sent $sent pieces now, $left left"
[ "$left" = 0 ] && echo "all pieces sent"
exit 0

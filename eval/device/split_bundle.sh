#!/usr/bin/env bash
# Split a bundle (a tar of wheels and data) into pieces that each travel beside the working tree to a GPU host
# whose commands take at most LIMIT bytes each (docs/gpu-host.md): the piece size is LIMIT minus what travels
# anyway (tracked and untracked, not ignored files of this checkout) minus MARGIN (room for anything else a
# command carries), so it shrinks as the repository grows instead of being a number in the docs that goes stale.
# Piece i is written to ${PREFIX}i/part_NN (git-ignored folders: carry one per command); prints the PARTS= and
# SHA= settings that eval/device/assemble.sh needs.
# Usage: [PREFIX=.carry] [LIMIT=67108864] [MARGIN=1048576] bash eval/device/split_bundle.sh BUNDLE.tar
set -euo pipefail
bundle=${1:?usage: bash eval/device/split_bundle.sh BUNDLE.tar}
PREFIX=${PREFIX:-.carry}
LIMIT=${LIMIT:-67108864}
MARGIN=${MARGIN:-1048576}
fail() { echo "split_bundle: $1" >&2; exit 1; }
[ -f "$bundle" ] || fail "no bundle at $bundle"
git rev-parse --show-toplevel > /dev/null 2>&1 || fail "run it from the checkout that travels"
cd "$(git rev-parse --show-toplevel)"
case "$bundle" in /*) ;; *) bundle="$OLDPWD/$bundle" ;; esac
git check-ignore -q "${PREFIX}0/part_00" ||
  fail "${PREFIX}0/ is not git-ignored: every piece would travel with every command (ignore ${PREFIX}*/)"
if compgen -G "${PREFIX}*/part_*" > /dev/null; then
  fail "${PREFIX}*/ already holds pieces (of another bundle?): remove them or choose another PREFIX"
fi
tree=0
while IFS= read -r -d '' f; do
  [ -f "$f" ] && tree=$((tree + $(stat -c %s "$f")))
done < <(git ls-files -z --cached --others --exclude-standard)
piece=$((LIMIT - tree - MARGIN))
[ "$piece" -ge 1048576 ] || fail "the working tree ($tree bytes) leaves no room for pieces under $LIMIT bytes"
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
split -b "$piece" -d -a 2 "$bundle" "$tmp/part_"
parts=0
for p in "$tmp"/part_*; do
  mkdir -p "${PREFIX}${parts}"
  mv "$p" "${PREFIX}${parts}/"
  parts=$((parts + 1))
done
echo "working tree $tree bytes, pieces of at most $piece bytes: ${PREFIX}0 ... ${PREFIX}$((parts - 1)), one per command"
echo "PARTS=$parts SHA=$(sha256sum "$bundle" | cut -d' ' -f1)"

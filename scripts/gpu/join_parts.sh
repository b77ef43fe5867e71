#!/usr/bin/env bash
# join_parts.sh DEST DIR...: gather the pieces of split wheels (NAME.whl.part-aa, -ab, ...) found in
# the DIRs into DEST, keeping only wheels whose pieces join into a valid zip (a missing or truncated
# piece would break the whole pip call of install-wheels). Prints what it kept and dropped.
set -uo pipefail
dest=$1
shift
mkdir -p "$dest"
declare -A seen=()
for dir in "$@"; do
  [[ -d $dir ]] || { echo "join_parts: no folder $dir"; continue; }
  for piece in "$dir"/*.part-*; do
    [[ -e $piece ]] || continue
    base=$(basename "$piece")
    [[ -n ${seen[$base]:-} ]] && continue
    seen[$base]=1
    cp "$piece" "$dest/$base"
  done
done
tmp=$(mktemp -d)
for first in "$dest"/*.part-aa; do
  [[ -e $first ]] || continue
  name=$(basename "$first" .part-aa)
  cat "$dest/$name".part-* >"$tmp/$name"
  if python3 - "$tmp/$name" <<'PY'; then
import sys, zipfile
with zipfile.ZipFile(sys.argv[1]) as z:
    bad = z.testzip()
    sys.exit(1 if bad else 0)
PY
    echo "join_parts: $name: $(ls "$dest/$name".part-* | wc -l) pieces, $(stat -c %s "$tmp/$name") bytes, valid"
  else
    echo "join_parts: $name: pieces do not make a valid wheel (missing piece?), dropped"
    rm -f "$dest/$name".part-*
  fi
  rm -f "$tmp/$name"
done
for piece in "$dest"/*.part-*; do  # pieces without a first piece
  [[ -e $piece ]] || continue
  name=${piece%.part-*}
  [[ -e $name.part-aa ]] || { echo "join_parts: $(basename "$piece"): no first piece, dropped"; rm -f "$piece"; }
done
rm -rf "$tmp"

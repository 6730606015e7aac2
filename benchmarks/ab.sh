#!/usr/bin/env bash
# A/B of the code at git revisions: one benchmark command against each revision's qsinkkv in turn, round after round
# (interleaved, so a noisy host moves every revision alike). Each revision is checked out once into a temporary
# worktree and put first on Python's path; the command itself (this clone's benchmarks/) is the same for all. "." is
# this clone's working tree, uncommitted changes included. From the clone's root:
#
#   bash benchmarks/ab.sh [--rounds N] [--out DIR] REV... -- COMMAND [ARG...]
#   bash benchmarks/ab.sh --rounds 3 28b3338 . -- python benchmarks/write_op.py --writer c
#
# Each run's stdout and stderr go to DIR/<rev>-<round>.txt (DIR: out/ab by default); the command also finds
# AB_REV, AB_ROUND and AB_OUT in its environment, e.g. for its own files: --json "\$AB_OUT/x-\$AB_REV-\$AB_ROUND.json"
# (quoted, so that they expand per run: the command runs through bash -c).
set -euo pipefail
rounds=1 out=out/ab revs=()
while [ $# -gt 0 ]; do
  case "$1" in
    --rounds) rounds=$2; shift 2 ;;
    --out) out=$2; shift 2 ;;
    --) shift; break ;;
    *) revs+=("$1"); shift ;;
  esac
done
[ ${#revs[@]} -gt 0 ] && [ $# -gt 0 ] || { sed -n '2,13p' "$0"; exit 2; }
root=$(git rev-parse --show-toplevel)
trees=$(mktemp -d)
trap 'for t in "$trees"/*/; do [ -d "$t" ] && git -C "$root" worktree remove --force "$t"; done; rm -rf "$trees"' EXIT
mkdir -p "$out"
declare -A path
for rev in "${revs[@]}"; do
  if [ "$rev" = . ]; then path[$rev]=$root; continue; fi
  git -C "$root" worktree add -q --detach "$trees/$rev" "$rev"
  path[$rev]=$trees/$rev
done
for round in $(seq 1 "$rounds"); do
  for rev in "${revs[@]}"; do
    name=$([ "$rev" = . ] && echo tree || echo "$rev")
    echo "ab: round $round, $name" >&2
    # (PYTHONSAFEPATH: neither the working directory nor the script's folder goes before the revision; benchmarks/
    # comes after it, for the scripts' shared helpers)
    AB_REV=$name AB_ROUND=$round AB_OUT=$out PYTHONSAFEPATH=1 \
      PYTHONPATH="${path[$rev]}:$root/benchmarks${PYTHONPATH:+:$PYTHONPATH}" bash -c "$*" > "$out/$name-$round.txt" 2>&1
  done
done
echo "ab: outputs in $out" >&2

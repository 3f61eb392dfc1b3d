#!/usr/bin/env bash
# What a finished run concludes, kept for lab/results: its settings (config.json, filter.json), cost line,
# metrics, reward curve and every score per triplet (wm_eval_*), and its log as run_log.txt with this
# machine's folders cut (the repository's root, the working folder, $RWML_CACHE, $ALFWORLD_DATA, $HOME).
# No adapter and no collection: what the lab's reports read, a few MB a run.
#   bash lab/keep_run.sh runs/over_seeds/seed71 lab/results/over_seeds/seed71 [runs/over_seeds/seed71.log]
set -euo pipefail
src=$1 dst=$2 log=${3:-$1.log}
[ -f "$src/config.json" ] || { echo "keep_run.sh: $src holds no run (no config.json)" >&2; exit 1; }
root=$(cd "$(dirname "$0")/.." && pwd)
mkdir -p "$dst"
for f in config.json cost.json filter.json metrics.jsonl reward_curve.png "$src"/wm_eval_*; do
    f=$(basename "$f")
    [ ! -f "$src/$f" ] || cp "$src/$f" "$dst/$f"
done
cut=(-e "s#$(cd "$src" && pwd -P)#<run>#g" -e "s#$root/##g" -e "s#$PWD/##g")  # where it ran: relative
for var in RWML_CACHE ALFWORLD_DATA HOME; do
    [ -z "${!var:-}" ] || cut+=(-e "s#${!var}#\$$var#g")
done
[ ! -f "$log" ] || sed "${cut[@]}" "$log" > "$dst/run_log.txt"
echo "kept $src in $dst ($(ls "$dst" | wc -l) files)"

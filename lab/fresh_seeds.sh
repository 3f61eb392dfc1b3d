#!/usr/bin/env bash
# The closing verdict on valid_unseen (the test split): the default run, `python train.py`, on fresh seeds
# (none chose anything), then a coin run of each seed (--reward-control coin: its matched COIN arm is another
# coin) on the same data: the collections, the warm-up's more games, the filter, the warm-up and the "before"
# scores are copied from the real run's folder and reused (their caches are keyed by content and settings,
# so the coin run would have made the same files).
# A run counts as done once it wrote wm_eval_rwml_train.json, its last score: its adapter is saved earlier,
# and a run cut between the two resumes. ARGS go to every train.py call; each run's log ends with GNU time's
# lines (wall time, peak memory); a resumed run appends to its log, so an interrupted attempt keeps its lines.
# CONTROLS: the reward controls run on each seed's data (default coin; "coin template" adds the GRPO run
# whose reward pays for the template rule's sentence), each in OUT/<control><seed>; and the checks that must
# be able to fail: coinb, a second coin (lab/coin_again.py), flip, GRPO's sign flipped (lab/flipped_sign.py).
#   SEEDS="41 42" OUT=runs/fresh bash lab/fresh_seeds.sh
#   SEEDS=51 OUT=runs/fresh5 bash lab/fresh_seeds.sh & SEEDS=52 OUT=runs/fresh5 bash lab/fresh_seeds.sh  # side by side
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PY:-.venv/bin/python}
OUT=${OUT:-runs/fresh}
OUT=${OUT#"$PWD/"}
SEEDS=${SEEDS:-41 42}
ARGS=${ARGS:-}
TIME="command time -v"
mkdir -p "$OUT"
# seed by seed: each seed's controls follow its real run, so a stop (a lost machine) loses only the seed in progress
for s in $SEEDS; do
    [ -f "$OUT/seed$s/wm_eval_rwml_train.json" ] || $TIME $PY train.py --seed "$s" $ARGS --out "$OUT/seed$s" >> "$OUT/seed$s.log" 2>&1
    for ctrl in ${CONTROLS:-coin}; do
        c=$OUT/$ctrl$s
        mkdir -p "$c"
        for d in collect collect_state heldout heldout_purposeful heldout_state warmup_walk warmup_play \
                 warmup_state filter; do
            [ -d "$c/$d" ] || [ ! -d "$OUT/seed$s/$d" ] || cp -r "$OUT/seed$s/$d" "$c/$d"
        done
        cp -n "$OUT/seed$s"/wm_eval_before_* "$c/"
        case $ctrl in
            coinb) run="lab/coin_again.py --reward-control coin" ;;
            flip) run=lab/flipped_sign.py ;;
            *) run="train.py --reward-control $ctrl" ;;
        esac
        [ -f "$c/wm_eval_rwml_train.json" ] || $TIME $PY $run --seed "$s" $ARGS --out "$c" >> "$c.log" 2>&1
    done
done

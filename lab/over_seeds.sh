#!/usr/bin/env bash
# The over-seeds study in one command: each seed's default run (`python train.py`), then on its data, filter,
# warm-up and "before" scores a GRPO run with a coin for a reward and one whose reward pays for the template
# rule's sentence (lab/fresh_seeds.sh); then PLAN.md's checks, which must be able to fail, on the same data: a
# second coin run (coinb) and GRPO's sign flipped (flip); then the per-seed tables and the verdict over seeds in
# words (lab/over_seeds_report.py). Its plan goes to OUT's lab/results folder as PLAN.md before any run.
#   SEEDS="61 62 63 64 65 66" HELDOUT_SEED=N OUT=runs/over_seeds bash lab/over_seeds.sh
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PY:-.venv/bin/python}
OUT=${OUT:-runs/over_seeds}
OUT=${OUT#"$PWD/"}
: "${SEEDS:?name the seeds, as PLAN.md does}" "${HELDOUT_SEED:?name the held-out seed, as PLAN.md does}"
SEEDS="$SEEDS" OUT="$OUT" CONTROLS="coin template coinb flip" ARGS="--heldout-seed $HELDOUT_SEED ${ARGS:-}" PY=$PY \
    bash lab/fresh_seeds.sh
$PY lab/over_seeds_report.py --out "$OUT/over_seeds.md" $(for s in $SEEDS; do echo "$OUT/seed$s"; done)

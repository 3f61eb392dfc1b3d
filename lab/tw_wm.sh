#!/usr/bin/env bash
# Does RWML learn TextWorld's world? Per seed: collect on train games (85 % of turns drawn by
# command kind, as stage 1), the warm-up (filter SFT), RWML and the matched WM SFT from it; each scored on the
# held-out explore triplets of SPLIT's games (20, drawn with seed 0, the same for every seed), 4 predictions at
# T 1, beside the base model and the content-free rules; then the tables with paired CIs (lab/rescore.py --evals).
# The recipe is stage 1's (train.py's defaults, chosen on ALFWorld's valid_seen; TextWorld's tau_d 0.02 and
# completion cap 128 from the reward audit, whose dev half is 10 TextWorld *test* games). Choices are made with
# SPLIT=dev; SPLIT=test scores frozen adapters, on games that chose tau_d.
#   bash lab/tw_wm.sh                  -> $OUT/tw_wm_$SPLIT.md
#   SPLIT=test bash lab/tw_wm.sh       (the same adapters: only the held-out set and the evaluations are new)
set -euo pipefail
cd "$(dirname "$0")/.."  # the repo root: train.py, eval.py, .venv, runs/
PY=${PY:-.venv/bin/python}
OUT=${OUT:-runs/tw_wm}
OUT=${OUT#"$PWD/"}  # under the repo: relative, as the results record it (not this machine's path)
SPLIT=${SPLIT:-dev}
SEEDS=${SEEDS:-"0 1 2"}
JOBS=${JOBS:-2}
GAMES=${GAMES:-16}              # train games per seed
TURNS=${TURNS:-8}               # step budget of an episode (the agent comparison's)
HELDOUT_GAMES=${HELDOUT_GAMES:-20}
EXTRA=${EXTRA:-}                # recipe changes tried on dev (e.g. "--sft-epochs 6"), the same for every stage
TW="--env textworld --action-mode choose --max-turns $TURNS --num-workers 0"
LOGS=$OUT/logs
source lab/jobs.sh  # in_parallel
H=$OUT/heldout_$SPLIT/transitions.jsonl
ev="$PY eval.py wm --transitions $H"

jobs=("heldout_$SPLIT [ -f $H ] && [ -f $OUT/heldout_$SPLIT/collect.json ] || $PY train.py collect $TW --split $SPLIT \
--num-games $HELDOUT_GAMES --seed 0 --out $OUT/heldout_$SPLIT")
for s in $SEEDS; do
    jobs+=("collect$s $PY train.py collect $TW --num-games $GAMES --seed $s $EXTRA --out $OUT/seed$s/collect")
done
in_parallel "${jobs[@]}"

jobs=()
for s in $SEEDS; do  # per seed: the warm-up, then RWML and WM SFT from it
    d=$OUT/seed$s
    common="--env textworld --transitions $d/collect/transitions.jsonl --filter-dir $d/filter --seed $s $EXTRA"
    jobs+=("train$s $PY train.py filter $common --out $d/filter && \
([ -f $d/rwml/adapter/adapter_config.json ] || $PY train.py wm $common --out $d/rwml --resume) && \
([ -f $d/wm_sft/adapter/adapter_config.json ] || $PY train.py wm-sft $common --out $d/wm_sft)")
done
in_parallel "${jobs[@]}"

E=$OUT/eval_$SPLIT
jobs=("base [ -f $E/base.json ] || $ev --out $E/base.json")
for rule in template nothing copy; do jobs+=("$rule [ -f $E/$rule.json ] || $ev --baseline $rule --out $E/$rule.json"); done
for s in $SEEDS; do
    for arm in warmup rwml wm_sft; do
        a=$OUT/seed$s/$arm/adapter
        [ $arm = warmup ] && a=$OUT/seed$s/filter/warmup_adapter
        jobs+=("${arm}$s [ -f $E/seed$s/$arm.json ] || $ev --adapter $a --seed $s --out $E/seed$s/$arm.json")
    done
done
in_parallel "${jobs[@]}"
$PY lab/rescore.py --evals "$E" --out "$OUT/tw_wm_$SPLIT.md"

#!/usr/bin/env bash
# The default run's recipe, re-chosen on the dev split: per seed one train collection, the
# filter variants (each its own warm-up split and kept triplets), then RWML recipes from a variant's warm-up;
# every arm scored on (a) its own training prompts (the variant's kept.jsonl) and (b) held-out valid_seen games.
#   RECIPES="name=filter:flags;..." FILTERS="name=flags;..." SEEDS="0" bash lab/recipe_dev.sh
# A recipe's flags may start with @SCRIPT, run instead of train.py (e.g. "flip=mixed:@lab/flipped_sign.py").
# Arms: warm-up of each filter variant (the `before`), and each recipe's RWML adapter. Scores: eval.py wm,
# greedy by default (EVAL_SAMPLES), on every kept triplet (a) and HELDOUT triplets of each held-out kind (b).
# Jobs go JOBS at a time (jobs.sh); logs in $OUT/logs/; reruns keep what is done. Table: lab/recipe_report.py.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PY:-.venv/bin/python}
OUT=${OUT:-runs/recipe_dev}
OUT=${OUT#"$PWD/"}  # under the repo: relative, as the results record it
SPLIT=${SPLIT:-valid_seen}
HELD_GAMES=${HELD_GAMES:-20}
HELDOUT=${HELDOUT:-96}
SEEDS=${SEEDS:-"0"}
EVAL_SAMPLES=${EVAL_SAMPLES:-0}
FILTERS=${FILTERS:-"plain="}
RECIPES=${RECIPES:-"default=plain:"}
COLLECT=${COLLECT:-}
SKIP_HELDOUT=${SKIP_HELDOUT:-}  # "1": score (a) only
JOBS=${JOBS:-2}
KINDS="explore purposeful"
H=$OUT/$SPLIT
LOGS=$OUT/logs
source lab/jobs.sh
score() {  # score STEM KEPT [eval.py flags]: (a) on KEPT, (b) on the held-out kinds
    local stem=$1 kept=$2 kind; shift 2
    mkdir -p "$(dirname "$stem")"
    [ -f "${stem}_train.json" ] || $PY eval.py wm --transitions "$kept" --eval-max-triplets 0 \
        --eval-samples "$EVAL_SAMPLES" --out "${stem}_train.json" "$@"
    [ -z "$SKIP_HELDOUT" ] || return 0
    for kind in $KINDS; do
        [ -f "${stem}_$kind.json" ] || $PY eval.py wm --transitions "$H/heldout_$kind/transitions.jsonl" \
            --eval-max-triplets "$HELDOUT" --eval-samples "$EVAL_SAMPLES" --out "${stem}_$kind.json" "$@"
    done
}
export PY H HELDOUT KINDS EVAL_SAMPLES SKIP_HELDOUT
export -f score
jobs=("held_explore $PY train.py collect --seed 0 --split $SPLIT --num-games $HELD_GAMES --out $H/heldout_explore"
      "held_purposeful $PY train.py collect --walkthrough --seed 0 --split $SPLIT --num-games $HELD_GAMES --out $H/heldout_purposeful")
for s in $SEEDS; do
    jobs+=("collect$s $PY train.py collect --seed $s $COLLECT --out $OUT/seed$s/collect")
done
IFS=';' read -ra filters <<< "$FILTERS"
IFS=';' read -ra recipes <<< "$RECIPES"
train=() evals=()
for s in $SEEDS; do
    d=$OUT/seed$s
    for f in "${filters[@]}"; do
        [ -n "${f// }" ] || continue
        fn=${f%%=*} flags=${f#*=}
        train+=("filter${s}_$fn after collect$s; $PY train.py filter --transitions $d/collect/transitions.jsonl --seed $s \
$flags --filter-dir $d/filter_$fn --out $d/filter_$fn")
        evals+=("warmup${s}_$fn after filter${s}_$fn held_explore held_purposeful; score $d/eval/warmup_$fn \
$d/filter_$fn/kept.jsonl --adapter $d/filter_$fn/warmup_adapter --seed $s")
    done
    for r in "${recipes[@]}"; do
        [ -n "${r// }" ] || continue
        rn=${r%%=*} rest=${r#*=}
        fn=${rest%%:*} flags=${rest#*:} script=train.py
        if [[ $flags == @* ]]; then script=${flags%% *} script=${script#@}; flags=${flags#@"$script"}; fi
        ff=$(for f in "${filters[@]}"; do [ "${f%%=*}" != "$fn" ] || echo "${f#*=}"; done)
        train+=("rwml${s}_$rn after filter${s}_$fn; [ -f $d/$rn/adapter/adapter_config.json ] || $PY $script wm \
--transitions $d/collect/transitions.jsonl --seed $s $ff --filter-dir $d/filter_$fn $flags --out $d/$rn --resume")
        evals+=("eval${s}_$rn after rwml${s}_$rn held_explore held_purposeful; score $d/eval/$rn \
$d/filter_$fn/kept.jsonl --adapter $d/$rn/adapter --seed $s")
    done
done
in_parallel "${jobs[@]}" "${train[@]}" "${evals[@]}"

#!/usr/bin/env bash
# RWML learning on the bundled 135M model, measured over seeds (make sanity):
#   bash sanity.sh      ->  $OUT/sanity.md (and results/sanity.md when OUT is the default)
# One collection of train games and one of held-out valid_seen games; one filter whose SFT copy is the warm-up
# (filter seed 0), shared by every seed so that each seed's arms start from the same model; then per seed:
# RWML from the warm-up and the matched controls WM SFT (same triplets, same order, same number of updates)
# and COIN (fair-coin reward). Every arm is scored on the same held-out triplets; the agent's invalid-action
# rate is measured for the warm-up and for each seed's RWML. Reruns keep what is done.
set -euo pipefail
cd "$(dirname "$0")"
PY=${PY:-.venv/bin/python}
OUT=${OUT:-runs/sanity}
SEEDS=${SEEDS:-"0 1 2"}
STEPS=${STEPS:-20}          # GRPO steps of RWML and COIN; updates of WM SFT
HELDOUT=${HELDOUT:-48}      # held-out triplets scored per arm (the same ones for every arm and seed)
AGENT_GAMES=${AGENT_GAMES:-4}
T=$OUT/collect/transitions.jsonl
H=$OUT/heldout/transitions.jsonl
F=$OUT/filter

$PY train.py collect --seed 0 --out "$OUT/collect"
$PY train.py collect --seed 0 --split valid_seen --num-games 6 --out "$OUT/heldout"
score() {  # score ADAPTER SEED OUT: held-out world-model accuracy
    [ -f "$3" ] || $PY eval.py wm --transitions "$H" --max-triplets "$HELDOUT" --adapter "$1" --seed "$2" --out "$3"
}
play() {  # play ADAPTER OUT: the agent on valid_seen games (seed 0: the same games and sampling for every arm)
    [ -f "$2" ] || $PY eval.py agent --split valid_seen --num-games "$AGENT_GAMES" --max-turns 10 --seeds 1 \
        --seed 0 --adapter "$1" --out "$2"
}
for s in $SEEDS; do
    d=$OUT/seed$s
    run=(--transitions "$T" --seed "$s" --max-steps "$STEPS" --filter-dir "$F" --filter-seed 0)
    [ -f "$d/rwml/adapter/adapter_config.json" ] || $PY train.py wm "${run[@]}" --out "$d/rwml" --resume
    [ -f "$d/coin/adapter/adapter_config.json" ] || $PY train.py wm "${run[@]}" --reward-control coin --out "$d/coin" --resume
    [ -f "$d/wm_sft/adapter/adapter_config.json" ] || $PY train.py wm-sft "${run[@]}" --out "$d/wm_sft"
    score "$F/warmup_adapter" 0 "$OUT/eval_warmup.json"  # the shared warm-up: once, after the first seed made it
    play "$F/warmup_adapter" "$OUT/agent_warmup.json"
    for arm in rwml wm_sft coin; do score "$d/$arm/adapter" "$s" "$d/eval_$arm.json"; done
    play "$d/rwml/adapter" "$d/agent_rwml.json"
done
$PY eval.py sanity "$OUT" --out "$OUT/sanity.md"
[ "$OUT" = runs/sanity ] && cp "$OUT/sanity.md" results/sanity.md || true

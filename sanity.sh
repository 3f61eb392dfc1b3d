#!/usr/bin/env bash
# RWML learning on the bundled 135M model, measured over seeds (make sanity):
#   bash sanity.sh      ->  $OUT/sanity.md (and results/sanity.md when OUT is the default)
# One collection of train games and one of held-out valid_seen games; then per seed: the warm-up (the
# filter's SFT copy), RWML from it, and from the same warm-up the matched controls WM SFT (same triplets,
# same order, same number of updates) and COIN (fair-coin reward); every arm scored on the same held-out
# triplets, and the agent's invalid-action rate before and after RWML. Reruns keep what is done.
set -euo pipefail
cd "$(dirname "$0")"
PY=${PY:-.venv/bin/python}
OUT=${OUT:-runs/sanity}
SEEDS=${SEEDS:-"0 1 2"}
STEPS=${STEPS:-24}          # GRPO steps of RWML and COIN; updates of WM SFT
AGENT_GAMES=${AGENT_GAMES:-4}
T=$OUT/collect/transitions.jsonl
H=$OUT/heldout/transitions.jsonl

$PY train.py collect --seed 0 --out "$OUT/collect"
$PY train.py collect --seed 0 --split valid_seen --num-games 6 --out "$OUT/heldout"
for s in $SEEDS; do
    d=$OUT/seed$s
    run=(--transitions "$T" --seed "$s" --max-steps "$STEPS" --filter-dir "$d/filter")
    [ -f "$d/rwml/adapter/adapter_config.json" ] || $PY train.py wm "${run[@]}" --out "$d/rwml" --resume
    [ -f "$d/coin/adapter/adapter_config.json" ] || $PY train.py wm "${run[@]}" --reward-control coin --out "$d/coin" --resume
    [ -f "$d/wm_sft/adapter/adapter_config.json" ] || $PY train.py wm-sft "${run[@]}" --out "$d/wm_sft"
    for arm in warmup rwml wm_sft coin; do
        adapter=$d/$arm/adapter; [ $arm = warmup ] && adapter=$d/filter/warmup_adapter
        [ -f "$d/eval_$arm.json" ] || $PY eval.py wm --transitions "$H" --adapter "$adapter" --seed "$s" \
            --out "$d/eval_$arm.json"
    done
    for arm in warmup rwml; do
        adapter=$d/rwml/adapter; [ $arm = warmup ] && adapter=$d/filter/warmup_adapter
        [ -f "$d/agent_$arm.json" ] || $PY eval.py agent --split valid_seen --num-games "$AGENT_GAMES" --max-turns 10 \
            --seeds 1 --seed "$s" --adapter "$adapter" --out "$d/agent_$arm.json"
    done
done
$PY eval.py sanity "$OUT" --out "$OUT/sanity.md"
[ "$OUT" = runs/sanity ] && cp "$OUT/sanity.md" results/sanity.md || true

#!/usr/bin/env bash
# On the dev split (valid_seen): which lever lifts the world model to the content-free template rule?
# Per seed: the train collection (16 games, as `python train.py`), MORE triplets for the warm-up only
# (expert walkthroughs and model-free play, explore_prob 1, of MORE_GAMES other train games: no model writes
# them), then lab/recipe_dev.sh's filter variants (warm-ups) and RWML recipes, each scored greedily on its own
# training prompts and 96 + 96 held-out valid_seen triplets; the template rule on the same held-out triplets.
#   MORE_GAMES=32 FILTERS="name=flags;..." RECIPES="name=filter:flags;..." SEEDS=0 bash lab/wm_dev.sh
# In FILTERS, @MORE stands for the walkthroughs and model-free play (--warmup-transitions @MORE), @MORE_MODEL
# for the walkthroughs and the collection policy's own play of the same games (MORE_MODEL=1 collects it).
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PY:-.venv/bin/python}
OUT=${OUT:-runs/wm_dev}
OUT=${OUT#"$PWD/"}
SPLIT=${SPLIT:-valid_seen}
SEEDS=${SEEDS:-0}
MORE_GAMES=${MORE_GAMES:-32}
MORE_SEED=${MORE_SEED:-100}  # other train games than the collection's (its seed draws them)
for s in $SEEDS; do
    d=$OUT/seed$s
    m=$((MORE_SEED + s))
    $PY train.py collect --walkthrough --split train --num-games "$MORE_GAMES" --seed $m --out "$d/more_walk"
    OMP_NUM_THREADS=${OMP_NUM_THREADS:-1} $PY train.py collect --explore-prob 1 --split train \
        --num-games "$MORE_GAMES" --seed $m --out "$d/more_explore"
    # the collection policy's own play (the model writes 15 % of turns, as `python train.py` collects): its
    # invalid actions give the "Nothing happens." targets the two above lack
    [ -z "${MORE_MODEL:-}" ] || OMP_NUM_THREADS=${OMP_NUM_THREADS:-1} $PY train.py collect --split train \
        --num-games "$MORE_GAMES" --seed $m --out "$d/more_model"
done
for kind in explore purposeful; do  # the content-free rule on the held-out triplets every arm is scored on
    f=$OUT/$SPLIT/template_$kind.json
    [ -f "$f" ] || $PY eval.py wm --transitions "$OUT/$SPLIT/heldout_$kind/transitions.jsonl" \
        --eval-max-triplets "${HELDOUT:-96}" --baseline template --out "$f"
done
for s in $SEEDS; do  # a seed at a time: @MORE names that seed's files
    more=$OUT/seed$s/more_walk/transitions.jsonl,$OUT/seed$s/more_explore/transitions.jsonl
    model=$OUT/seed$s/more_walk/transitions.jsonl,$OUT/seed$s/more_model/transitions.jsonl
    f=${FILTERS//@MORE_MODEL/$model}
    FILTERS=${f//@MORE/$more} OUT=$OUT SPLIT=$SPLIT SEEDS=$s bash lab/recipe_dev.sh
done

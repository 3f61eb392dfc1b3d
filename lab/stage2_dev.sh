#!/usr/bin/env bash
# Why is stage 2's gain small? On the TextWorld dev games only: policy RL from the base with
# stage2_test.sh's recipe, continued (--resume) to each step count of STEPS, its adapter scored sampled (T 1,
# EPISODES per game) after each; beside the base and a random admissible policy on the same games. GAMES_PER_STEP,
# LR, HISTORY are the other knobs tried (a run per setting). Fresh seeds (not 0, which chose the recipe, nor
# stage2_test.sh's 10-12).
#   bash lab/stage2_dev.sh     -> $OUT/stage2_dev_$TAG.md (lab/agent_stats.py after each step count)
set -euo pipefail
cd "$(dirname "$0")/.."  # the repo root: train.py, eval.py, .venv, runs/
PY=${PY:-.venv/bin/python}
OUT=${OUT:-runs/stage2_dev}
OUT=${OUT#"$PWD/"}  # under the repo: relative, as the results record it (not this machine's path)
SEEDS=${SEEDS:-"20 21"}
JOBS=${JOBS:-2}
STEPS=${STEPS:-"3 6 12"}        # stage-2 steps after which the adapter is scored (one run, continued)
GAMES_PER_STEP=${GAMES_PER_STEP:-2}
LR=${LR:-1e-3}
HISTORY=${HISTORY:-1}
EVAL_GAMES=${EVAL_GAMES:-20}    # dev games, the same for every arm (eval.py draws them with its seed 0)
EPISODES=${EPISODES:-4}
RANDOM_STREAMS=${RANDOM_STREAMS:-20}
TW="--env textworld --action-mode choose --max-turns 8 --num-workers 0 --history-len $HISTORY"
RECIPE="--loss-type grpo --scale-rewards group --num-games 16 --games-per-step $GAMES_PER_STEP --num-generations 4 \
--beta 0.0 --learning-rate $LR --temperature 1.0"  # stage2_test.sh's, but for the knobs above
TAG=g${GAMES_PER_STEP}_lr${LR}_h$HISTORY
LOGS=$OUT/logs
source lab/jobs.sh  # in_parallel
ev="$PY eval.py agent $TW --split dev --num-games $EVAL_GAMES"
jobs=("random_h$HISTORY [ -f $OUT/random_h$HISTORY/sampled.json ] || $ev --policy random --seeds $RANDOM_STREAMS --out $OUT/random_h$HISTORY/sampled.json"
      "base_h$HISTORY [ -f $OUT/base_h$HISTORY/sampled.json ] || $ev --sampled --temperature 1.0 --seeds $EPISODES --out $OUT/base_h$HISTORY/sampled.json")
for s in $SEEDS; do
    d=$OUT/$TAG/seed$s
    run=""
    for n in $STEPS; do
        run+="[ -f $d/step$n/sampled.json ] || { $PY train.py policy $TW $RECIPE --seed $s --init base --max-steps $n \
--save-steps 1 --eval-steps 0 --out $d/run --resume && rm -rf $d/step$n/adapter && mkdir -p $d/step$n && \
cp -r $d/run/adapter $d/step$n/adapter && $ev --adapter $d/step$n/adapter --sampled --temperature 1.0 \
--seeds $EPISODES --out $d/step$n/sampled.json; }; "
    done
    jobs+=("${TAG}_seed$s $run")
done
in_parallel "${jobs[@]}"
for n in $STEPS; do  # one table per step count: policy RL (the seeds) against base and random, paired on games
    echo "## after $n steps ($TAG)"
    $PY lab/agent_stats.py "$OUT" --split dev --random random_h$HISTORY --base base_h$HISTORY --policy "$TAG/seed*/step$n"
    echo
done > "$OUT/stage2_dev_$TAG.md"
cat "$OUT/stage2_dev_$TAG.md"

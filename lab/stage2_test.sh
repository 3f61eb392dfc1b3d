#!/usr/bin/env bash
# Does stage 2 learn? Policy RL from the base model against the base and a random admissible
# policy on TextWorld's test games, paired on the same games: sampled (T 1, EPISODES episodes per game, the policy
# stage 2 trains) and greedy (one episode per game); RANDOM_STREAMS random episodes per game. Fresh seeds: none
# of them chose the recipe (agent_sanity.sh's, chosen on the dev games with seed 0), each draws its own train games.
#   bash lab/stage2_test.sh      -> $OUT/stage2_test.md (python lab/agent_stats.py $OUT)
set -euo pipefail
cd "$(dirname "$0")/.."  # the repo root: train.py, eval.py, .venv, runs/
PY=${PY:-.venv/bin/python}
OUT=${OUT:-runs/stage2_test}
OUT=${OUT#"$PWD/"}  # under the repo: relative, as the results record it (not this machine's path)
SEEDS=${SEEDS:-"10 11 12"}
JOBS=${JOBS:-1}
EVAL_GAMES=${EVAL_GAMES:-20}    # test games, the same for every arm (eval.py draws them with its seed 0)
EPISODES=${EPISODES:-4}         # sampled episodes per game and model
RANDOM_STREAMS=${RANDOM_STREAMS:-20}
STEPS=${STEPS:-3}               # stage-2 steps (3: agent_sanity.sh's; 6: chosen on the dev games, stage2_dev.sh)
TW="--env textworld --action-mode choose --max-turns 8 --num-workers 0"
RECIPE="--loss-type grpo --scale-rewards group --num-games 16 --games-per-step 2 --num-generations 4 --max-steps $STEPS \
--beta 0.0 --learning-rate 1e-3 --temperature 1.0"  # agent_sanity.sh's stage 2 (STEPS apart)
LOGS=$OUT/logs
source lab/jobs.sh  # in_parallel
ev="$PY eval.py agent $TW --split test --num-games $EVAL_GAMES"
both() {  # both DIR [--adapter A]: greedy, then sampled
    echo "[ -f $1/sampled.json ] || { $ev ${2:-} --out $1/greedy.json && \
$ev ${2:-} --sampled --temperature 1.0 --seeds $EPISODES --out $1/sampled.json; }"
}
jobs=("random [ -f $OUT/random/sampled.json ] || $ev --policy random --seeds $RANDOM_STREAMS --out $OUT/random/sampled.json"
      "base $(both $OUT/base)")
for s in $SEEDS; do
    d=$OUT/seed$s/policy
    jobs+=("policy$s [ -f $d/adapter/adapter_config.json ] || $PY train.py policy $TW $RECIPE --seed $s --init base \
--save-steps 1 --eval-steps 0 --out $d --resume; $(both $d "--adapter $d/adapter")")
done
in_parallel "${jobs[@]}"
$PY lab/agent_stats.py "$OUT" --out "$OUT/stage2_test.md"

#!/usr/bin/env bash
# The paper's agent comparison on a laptop: TextWorld, choose mode, five arms, greedy success on held-out
# dev and test games; stage 2 over seeds, with its dev curve:
#   bash lab/agent_sanity.sh      (or: make agent-sanity)  -> $OUT/agent_sanity.md, $OUT/agent_sanity_curve.png
# POLICY_T, POLICY_LR: chosen on the dev games (NOTEBOOK.md); the step sizes fit the time budget, not tuned.
# Stage 1 runs once, shared by the seeds. Jobs: JOBS at a time (jobs.sh); logs in $OUT/logs/; reruns keep what is done.
set -euo pipefail
cd "$(dirname "$0")/.."  # the repo root: train.py, eval.py, .venv, runs/
PY=${PY:-.venv/bin/python}
OUT=${OUT:-runs/agent_sanity}
OUT=${OUT#"$PWD/"}  # under the repo: relative, as the results record it (not this machine's path)
SEEDS=${SEEDS:-"0 1 2"}
JOBS=${JOBS:-2}
GAMES=${GAMES:-16}              # train games: stage 1's triplets, and the pool stage 2 draws from
TURNS=${TURNS:-8}               # step budget of an episode
WM_STEPS=${WM_STEPS:-20}        # RWML GRPO steps (4 prompts x 4), the stage-1 recipe; as many WM SFT updates
POLICY_STEPS=${POLICY_STEPS:-3} # stage-2 steps: POLICY_GAMES games x POLICY_GEN episodes each
POLICY_GAMES=${POLICY_GAMES:-2}
POLICY_GEN=${POLICY_GEN:-4}
POLICY_LR=${POLICY_LR:-1e-3}
POLICY_T=${POLICY_T:-1.0}       # the choice softmax's temperature while sampling (evaluation is greedy)
EVAL_GAMES=${EVAL_GAMES:-20}    # held-out games per split (dev, test): every arm's final evaluation, the table
EVAL_EVERY=${EVAL_EVERY:-0}     # the dev curve is the start's and the end's evaluations (step 0, POLICY_STEPS);
CURVE_GAMES=${CURVE_GAMES:-$EVAL_GAMES}  # EVAL_EVERY > 0 adds points in between, on CURVE_GAMES dev games
TW="--env textworld --action-mode choose --max-turns $TURNS --num-workers 0"
# the recipe these scripts were measured with, before stage 1's defaults moved to Dr. GRPO without the easy filter
OLD="--loss-type grpo --scale-rewards group"
LOGS=$OUT/logs
source lab/jobs.sh  # in_parallel
mkdir -p "$OUT/base"

# --- stage 1, shared: collect (85 % of turns drawn by command kind, as the stage-1 recipe), filter + warm-up
T=$OUT/collect/transitions.jsonl
JOBS=1 in_parallel "collect $PY train.py collect $TW --num-games $GAMES --out $OUT/collect"
JOBS=1 in_parallel "filter $PY train.py filter --easy-filter $OLD --transitions $T --filter-dir $OUT/filter --out $OUT/filter"
wm="--transitions $T --max-steps $WM_STEPS --filter-dir $OUT/filter --easy-filter $OLD"
evaluate="$PY eval.py agent $TW --num-games $EVAL_GAMES"  # greedy, one pass (seeds would replay it)
in_parallel "rwml [ -f $OUT/rwml/adapter/adapter_config.json ] || $PY train.py wm $wm --out $OUT/rwml --resume" \
            "wm_sft [ -f $OUT/wm_sft/adapter/adapter_config.json ] || $PY train.py wm-sft $wm --out $OUT/wm_sft" \
            "eval_base [ -f $OUT/base/eval_agent.json ] || $evaluate --split dev,test --out $OUT/base/eval_agent.json" \
            "eval_random [ -f $OUT/random/eval_agent.json ] || $evaluate --policy random --seeds 3 --split dev,test --out $OUT/random/eval_agent.json"

# --- stage 2 per seed (a run, then its dev and test games), the stage-1 arms' evaluations (the curves' step 0)
jobs=("eval_rwml [ -f $OUT/rwml/eval_agent.json ] || $evaluate --adapter $OUT/rwml/adapter --split dev,test --out $OUT/rwml/eval_agent.json"
      "eval_wm_sft [ -f $OUT/wm_sft/eval_agent.json ] || $evaluate --adapter $OUT/wm_sft/adapter --split dev --out $OUT/wm_sft/eval_agent.json")
for arm in policy rwml_policy wm_sft_policy; do  # policy RL of every seed first: the claim that stage 2 learns
    for s in $SEEDS; do
        case $arm in policy) init="--init base" ;; rwml_policy) init="--init rwml --adapter $OUT/rwml/adapter" ;;
                     wm_sft_policy) init="--init wm-sft --adapter $OUT/wm_sft/adapter" ;; esac
        d=$OUT/seed$s/$arm
        jobs+=("${arm}$s [ -f $d/adapter/adapter_config.json ] || $PY train.py policy $TW $OLD --seed $s $init --num-games $GAMES \
--games-per-step $POLICY_GAMES --num-generations $POLICY_GEN --max-steps $POLICY_STEPS --beta 0.0 \
--learning-rate $POLICY_LR --temperature $POLICY_T --save-steps 1 --eval-steps $EVAL_EVERY --eval-games $CURVE_GAMES \
--out $d --resume; [ -f $d/eval_agent.json ] || $evaluate --adapter $d/adapter --split dev,test --out $d/eval_agent.json")
    done
done
in_parallel "${jobs[@]}"
$PY lab/reports.py agent-table "$OUT" --out "$OUT/agent_sanity.md"
if [ "$OUT" = runs/agent_sanity ]; then  # the table, the curve and each run's small files (no adapters) -> lab/results/
    (cd "$OUT" && find . \( -name adapter -o -name checkpoint -o -name warmup_adapter \) -prune -o -type f \( \
        -name 'agent_sanity*' -o -name eval_agent.json -o -name eval_episodes.jsonl -o -name metrics.jsonl \
        -o -name cost.json -o -name filter.json -o -name collect.json \) -print) |
        while read -r f; do mkdir -p "lab/results/agent_sanity/$(dirname "$f")"; cp "$OUT/$f" "lab/results/agent_sanity/$f"; done
fi

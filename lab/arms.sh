#!/usr/bin/env bash
# Every arm of the paper's comparison (METHOD.md §7 and Table 1), one command each, then one table:
#   bash lab/arms.sh        (or: make arms)   ->  $OUT/results.md, $OUT/results_rewards.png, $OUT/results_success.png
# The defaults: the small CPU version (135M, a few games and steps; ~30 min on 2 cores). Scale, e.g. on a GPU:
#   MODEL=Qwen/Qwen2.5-1.5B-Instruct GAMES=200 ROLLOUTS=3 TURNS=30 WM_STEPS=200 POLICY_STEPS=50 EVAL_GAMES=0 SEEDS=3 bash lab/arms.sh
# A rerun continues: collection, training from its checkpoint; finished evaluations are kept.
set -euo pipefail
cd "$(dirname "$0")/.."  # the repo root: train.py, eval.py, .venv, runs/
PY=${PY:-.venv/bin/python}
OUT=${OUT:-runs/arms}
OUT=${OUT#"$PWD/"}  # under the repo: relative, as the results record it (not this machine's path)
MODEL=${MODEL:-bundled:SmolLM2-135M-Instruct}
GAMES=${GAMES:-4}                 # train games the base model plays for triplets (paper: all 3553)
ROLLOUTS=${ROLLOUTS:-1}           # paper: 3
TURNS=${TURNS:-8}                 # step budget when collecting, in policy RL and in evaluation (paper: 30)
WM_STEPS=${WM_STEPS:-4}           # GRPO steps of RWML and of its controls MIS and COIN
POLICY_GAMES=${POLICY_GAMES:-4}   # train games stage 2 draws from, one per step
POLICY_STEPS=${POLICY_STEPS:-2}
POLICY_BETA=${POLICY_BETA:-0.0}   # 0: groups with all-equal success add nothing and are not computed
EVAL_GAMES=${EVAL_GAMES:-2}       # per split: valid_seen (ID) and valid_unseen (OOD); 0 = whole splits
SEEDS=${SEEDS:-2}
TOKENS=${TOKENS:-64}              # agent reply length
T=$OUT/collect/transitions.jsonl
M=(--model "$MODEL")

# --- data: the base model plays train games (every turn a triplet), and held-out games for WM accuracy
$PY train.py collect "${M[@]}" --num-games "$GAMES" --rollouts-per-game "$ROLLOUTS" --max-turns "$TURNS" \
    --max-new-tokens "$TOKENS" --out "$OUT/collect"
$PY train.py collect "${M[@]}" --split valid_seen --num-games 2 --rollouts-per-game 1 --max-turns "$TURNS" \
    --max-new-tokens "$TOKENS" --out "$OUT/heldout"

# --- stage 1 and its baselines: RWML, the controls MIS and COIN (same filtered triplets), WM SFT
$PY train.py wm "${M[@]}" --transitions "$T" --max-steps "$WM_STEPS" --out "$OUT/rwml" --resume
for control in mis coin; do
    mkdir -p "$OUT/$control" && cp -rn "$OUT/rwml/filter" "$OUT/$control/"  # the same kept triplets
    $PY train.py wm "${M[@]}" --transitions "$T" --max-steps "$WM_STEPS" --reward-control $control \
        --out "$OUT/$control" --resume
done
[ -f "$OUT/wm_sft/adapter/adapter_config.json" ] || $PY train.py wm-sft "${M[@]}" --transitions "$T" --out "$OUT/wm_sft"
# RFT: SFT on the model's own successful episodes; a model that wins none has nothing to learn from
[ -f "$OUT/rft/adapter/adapter_config.json" ] || $PY train.py rft "${M[@]}" --num-games "$GAMES" --rollouts-per-game 2 \
    --max-turns "$TURNS" --max-new-tokens "$TOKENS" --out "$OUT/rft" || echo "arms.sh: no RFT arm (see the line above)"

# --- stage 2: policy RL on task success from the base model, from RWML, from WM SFT
policy() {  # policy OUT_NAME INIT [ADAPTER]
    $PY train.py policy "${M[@]}" --init "$2" ${3:+--adapter "$3"} --num-games "$POLICY_GAMES" --games-per-step 1 \
        --num-generations 2 --max-turns "$TURNS" --max-new-tokens "$TOKENS" --max-steps "$POLICY_STEPS" \
        --beta "$POLICY_BETA" --out "$OUT/$1" --resume
}
policy policy base
policy rwml_policy rwml "$OUT/rwml/adapter"
policy wm_sft_policy wm-sft "$OUT/wm_sft/adapter"

# --- evaluation of every arm: agent success ID / OOD, world-model accuracy, weight change
ARMS=(base policy wm_sft rwml wm_sft_policy rwml_policy mis coin)
[ -f "$OUT/rft/adapter/adapter_config.json" ] && ARMS+=(rft)
mkdir -p "$OUT/base"
for arm in "${ARMS[@]}"; do
    dir=$OUT/$arm
    adapter=(); [ "$arm" = base ] || adapter=(--adapter "$dir/adapter")
    reasoning=(); [[ "$arm" == wm_sft* ]] && reasoning=(--no-wm-reasoning)  # WM SFT learned to answer without <think>
    games=(); [ "$EVAL_GAMES" = 0 ] || games=(--num-games "$EVAL_GAMES")
    [ -f "$dir/eval_agent.json" ] || $PY eval.py agent "${M[@]}" "${adapter[@]}" --split valid_seen,valid_unseen \
        "${games[@]}" --seeds "$SEEDS" --max-turns "$TURNS" --max-new-tokens "$TOKENS" --out "$dir/eval_agent.json"
    [ -f "$dir/eval_wm.json" ] || $PY eval.py wm "${M[@]}" "${adapter[@]}" "${reasoning[@]}" \
        --transitions "$OUT/heldout/transitions.jsonl" --out "$dir/eval_wm.json"
    [ "$arm" = base ] || [ -f "$dir/weights.json" ] || $PY eval.py weights "${M[@]}" "${adapter[@]}" --out "$dir/weights.json"
done
$PY lab/reports.py report "${ARMS[@]/#/$OUT/}" --out "$OUT/results.md"

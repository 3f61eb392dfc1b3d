#!/usr/bin/env bash
# The paper's agent comparison on a laptop (issue 22): TextWorld generated games, --action-mode choose (the
# policy is the LM's softmax over the admissible commands, so no action is invalid), 3 seeds, five arms:
#   base | RWML | policy RL | RWML + policy RL | WM SFT + policy RL
# success on held-out dev and test games (greedy), then one table ($OUT/agent_sanity.md).
#   bash agent_sanity.sh      (or: make agent-sanity)
# Sized for <= 90 minutes on 2 CPU cores (estimated from measured per-step costs, README; not yet run
# whole): the world-model stage (collection, RWML, WM SFT) runs once and is shared by the seeds; the stage-2
# runs of a seed and the evaluations go two at a time (one thread each). Rerun after an interruption:
# finished steps are kept (collect continues, training resumes, finished evaluations are skipped).
set -euo pipefail
cd "$(dirname "$0")"
export OMP_NUM_THREADS=1
PY=${PY:-.venv/bin/python}
OUT=${OUT:-runs/agent_sanity}
SEEDS=${SEEDS:-"0 1 2"}
GAMES=${GAMES:-16}                # train games: triplets for stage 1, and the pool stage 2 draws from
TURNS=${TURNS:-8}                 # step budget (random admissible policy: 28 % success at 10 steps, README)
WM_STEPS=${WM_STEPS:-20}          # RWML GRPO steps (4 prompts x 4), the stage-1 recipe
POLICY_STEPS=${POLICY_STEPS:-6}   # stage-2 steps per run: 1 game x 4 episodes each
EVAL_GAMES=${EVAL_GAMES:-10}      # per held-out split (dev, test)
TW=(--env textworld --action-mode choose --max-turns "$TURNS" --num-workers 0)
mkdir -p "$OUT"

# --- stage 1, shared: collect (85 % of turns drawn by command kind, as the stage-1 recipe), RWML, WM SFT
$PY train.py collect "${TW[@]}" --num-games "$GAMES" --out "$OUT/collect"
T=$OUT/collect/transitions.jsonl
$PY train.py wm --transitions "$T" --max-steps "$WM_STEPS" --out "$OUT/rwml" --resume
mkdir -p "$OUT/wm_sft" && cp -rn "$OUT/rwml/filter" "$OUT/wm_sft/"  # the same kept triplets and warm-up
[ -f "$OUT/wm_sft/adapter/adapter_config.json" ] || $PY train.py wm-sft --transitions "$T" --max-steps "$WM_STEPS" \
    --out "$OUT/wm_sft"

evaluate() {  # evaluate DIR [ADAPTER]: greedy, one pass (seeds would replay it)
    [ -f "$1/eval_agent.json" ] || $PY eval.py agent "${TW[@]}" ${2:+--adapter "$2"} --split dev,test \
        --num-games "$EVAL_GAMES" --out "$1/eval_agent.json"
}
policy() {  # policy SEED NAME INIT [ADAPTER]
    $PY train.py policy "${TW[@]}" --seed "$1" --init "$3" ${4:+--adapter "$4"} --num-games "$GAMES" \
        --games-per-step 1 --num-generations 4 --max-steps "$POLICY_STEPS" --beta 0.0 --learning-rate 1e-4 \
        --save-steps 1 --out "$OUT/seed$1/$2" --resume && evaluate "$OUT/seed$1/$2" "$OUT/seed$1/$2/adapter"
}
mkdir -p "$OUT/base"
evaluate "$OUT/base" & evaluate "$OUT/rwml" "$OUT/rwml/adapter"; wait
for s in $SEEDS; do
    policy "$s" policy base & policy "$s" rwml_policy rwml "$OUT/rwml/adapter"; wait
    policy "$s" wm_sft_policy wm-sft "$OUT/wm_sft/adapter"
done

# --- the table: success (%) on dev and test, per seed, mean and spread
$PY - "$OUT" $SEEDS <<'EOF'
import json, statistics, sys
from pathlib import Path
out, seeds = Path(sys.argv[1]), sys.argv[2:]
def rate(f, split):
    return json.loads(f.read_text())["per_split"][split]["success_rate"] if f.is_file() else None
arms = [("base", lambda s: out / "base"), ("RWML", lambda s: out / "rwml"), ("policy RL", lambda s: out / f"seed{s}/policy"),
        ("RWML + policy RL", lambda s: out / f"seed{s}/rwml_policy"), ("WM SFT + policy RL", lambda s: out / f"seed{s}/wm_sft_policy")]
lines = ["| arm | dev success (%) | test success (%) | per seed (test) |", "|---|---|---|---|"]
for name, folder in arms:
    cells = []
    for split in ("dev", "test"):
        xs = [x for s in seeds if (x := rate(folder(s) / "eval_agent.json", split)) is not None]
        cells.append(f"{100 * statistics.fmean(xs):.1f} ± {100 * statistics.pstdev(xs):.1f}" if xs else "–")
    per = [rate(folder(s) / "eval_agent.json", "test") for s in seeds]
    lines.append(f"| {name} | {cells[0]} | {cells[1]} | " + " / ".join("–" if x is None else f"{100 * x:.0f}" for x in per) + " |")
text = "\n".join(lines) + "\n"
(out / "agent_sanity.md").write_text(text)
print(text)
EOF

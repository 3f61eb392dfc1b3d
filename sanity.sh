#!/usr/bin/env bash
# RWML learning on the bundled 135M model, measured over seeds (make sanity):
#   bash sanity.sh      ->  $OUT/sanity.md (and results/sanity.md when OUT is the default)
# One collection of train games and one of held-out valid_seen games; one filter whose SFT copy is the warm-up
# (filter seed 0), shared by every seed so that each seed's arms start from the same model; then per seed:
# RWML from the warm-up and the matched controls WM SFT (same triplets, same order, same number of updates)
# and COIN (fair-coin reward). Every arm, and the warm-up, is scored on the same held-out triplets with the
# seed's sampling; the agent's invalid-action rate is measured for the warm-up and the first seed's RWML.
# Independent runs go JOBS at a time, one thread each: on 2 cores two 1-thread RWML runs took 30 s a step each,
# one 2-thread run 19 s (small matrices scale badly across threads). Logs: $OUT/logs/. Reruns keep what is done.
set -euo pipefail
cd "$(dirname "$0")"
PY=${PY:-.venv/bin/python}
OUT=${OUT:-runs/sanity}
SEEDS=${SEEDS:-"0 1 2"}
COIN_SEEDS=${COIN_SEEDS:-$SEEDS}  # seeds that also run the COIN control
STEPS=${STEPS:-20}          # GRPO steps of RWML and COIN (x 4 prompts = 80: every kept triplet once); WM SFT updates
HELDOUT=${HELDOUT:-48}      # held-out triplets scored per arm (the same ones for every arm and seed)
AGENT_GAMES=${AGENT_GAMES:-4}
JOBS=${JOBS:-2}
T=$OUT/collect/transitions.jsonl
H=$OUT/heldout/transitions.jsonl
F=$OUT/filter
mkdir -p "$OUT/logs"

in_parallel() {  # in_parallel "NAME COMMAND..." ...: each command a job, JOBS at a time, one thread each
    local threads=$(($(nproc) / JOBS)) spec pids=() names=()
    for spec in "$@"; do
        while [ "$(jobs -rp | wc -l)" -ge "$JOBS" ]; do sleep 2; done
        OMP_NUM_THREADS=$((threads > 0 ? threads : 1)) bash -c "${spec#* }" > "$OUT/logs/${spec%% *}.log" 2>&1 &
        pids+=($!) names+=("${spec%% *}")
    done
    for i in "${!pids[@]}"; do
        wait "${pids[$i]}" || {  # stop the jobs still running: a rerun must not race them
            for p in $(jobs -rp); do pkill -P "$p"; kill "$p"; done 2>/dev/null
            echo "sanity.sh: ${names[$i]} failed, see $OUT/logs/${names[$i]}.log"; exit 1; }
        echo "done: ${names[$i]}"
    done
}
score() {  # score ADAPTER SEED OUT: held-out world-model accuracy
    [ -f "$3" ] || $PY eval.py wm --transitions "$H" --max-triplets "$HELDOUT" --adapter "$1" --seed "$2" --out "$3"
}
play() {  # play ADAPTER OUT: the agent on valid_seen games (seed 0: the same games and sampling for every arm)
    [ -f "$2" ] || $PY eval.py agent --split valid_seen --num-games "$AGENT_GAMES" --max-turns 10 --seeds 1 \
        --seed 0 --adapter "$1" --out "$2"
}

export PY H HELDOUT AGENT_GAMES
export -f score play
in_parallel "collect $PY train.py collect --seed 0 --out $OUT/collect" \
    "heldout $PY train.py collect --seed 0 --split valid_seen --num-games 6 --out $OUT/heldout"
JOBS=1 in_parallel "filter $PY train.py filter --transitions $T --filter-dir $F --filter-seed 0 --seed 0 --out $F"
train=() later=() evals=()  # the long runs first; what needs only the warm-up fills the lanes' ends
for s in $SEEDS; do
    d=$OUT/seed$s
    run="--transitions $T --seed $s --max-steps $STEPS --filter-dir $F --filter-seed 0"
    train+=("rwml$s [ -f $d/rwml/adapter/adapter_config.json ] || $PY train.py wm $run --out $d/rwml --resume")
    later+=("wm_sft$s [ -f $d/wm_sft/adapter/adapter_config.json ] || $PY train.py wm-sft $run --out $d/wm_sft")
    later+=("eval_warmup$s score $F/warmup_adapter $s $d/eval_warmup.json")
    for arm in rwml wm_sft; do evals+=("eval_$arm$s score $d/$arm/adapter $s $d/eval_$arm.json"); done
    case " $COIN_SEEDS " in *" $s "*)
        train+=("coin$s [ -f $d/coin/adapter/adapter_config.json ] || $PY train.py wm $run --reward-control coin --out $d/coin --resume")
        evals+=("eval_coin$s score $d/coin/adapter $s $d/eval_coin.json") ;;
    esac
done
first=${SEEDS%% *}
later+=("agent_warmup play $F/warmup_adapter $OUT/agent_warmup.json")
evals+=("agent_rwml$first play $OUT/seed$first/rwml/adapter $OUT/seed$first/agent_rwml.json")
in_parallel "${train[@]}" "${later[@]}"
in_parallel "${evals[@]}"
$PY eval.py sanity "$OUT" --out "$OUT/sanity.md"
[ "$OUT" = runs/sanity ] && cp "$OUT/sanity.md" results/sanity.md || true

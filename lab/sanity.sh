#!/usr/bin/env bash
# RWML learning on the bundled 135M model over independent seeds (make sanity):
#   bash lab/sanity.sh                  ->  $OUT/sanity_valid_unseen.md (and lab/results/ when OUT is the default)
#   SPLIT=valid_seen bash lab/sanity.sh     the same runs scored on the dev split, where settings are chosen
# Held out, the same for every seed: HELD_GAMES games of SPLIT as `explore` (the collection policy's, seed 0)
# and `purposeful` (expert walkthroughs) triplets. Scored: the baselines, the base model, and per seed (its own
# train games, collection, filter) the warm-up, RWML from it and the matched controls WM SFT and COIN.
# Jobs go JOBS at a time, one thread each, in one queue (jobs.sh); logs in $OUT/logs/; reruns keep what is done.
set -euo pipefail
cd "$(dirname "$0")/.."  # the repo root: train.py, eval.py, .venv, runs/
PY=${PY:-.venv/bin/python}
OUT=${OUT:-runs/sanity}
OUT=${OUT#"$PWD/"}  # under the repo: relative, as the results record it (not this machine's path)
SPLIT=${SPLIT:-valid_unseen}
HELD_GAMES=${HELD_GAMES:-20}
HELDOUT=${HELDOUT:-48}      # triplets of each held-out kind scored per arm (the same ones for every arm and seed)
SEEDS=${SEEDS:-"0 1 2"}
COIN_SEEDS=${COIN_SEEDS:-$SEEDS}  # seeds that also run the COIN control (none when SKIP names coin)
VARIANTS=${VARIANTS:-}      # more RWML arms, "name=flags;..." (e.g. "kl=--beta 1.0") -> seed*/rwml_<name>, from the
#                             same warm-up; {d} in the flags: the seed's folder (e.g. "--filter-dir {d}/filter_x")
VARIANT_SEEDS=${VARIANT_SEEDS:-$SEEDS}  # the seeds that run the VARIANTS
SKIP=${SKIP:-}              # arms neither trained nor scored (e.g. "base wm_sft coin": a quicker dev comparison)
COLLECT=${COLLECT:-}        # more flags for the seeds' train collections (e.g. "--num-games 48": more triplets)
FLAGS=${FLAGS:-}            # more flags for every filter and training run (e.g. "--config configs/paper.json")
STEPS=${STEPS:-20}          # GRPO steps of RWML and COIN; WM SFT updates
CURVE_EVERY=${CURVE_EVERY:-0}  # the GRPO arms' held-out curve: CURVE triplets of SPLIT's explore set every this
CURVE=${CURVE:-16}              # many steps, at the start and at the end (0: no curve); training is unchanged
JOBS=${JOBS:-2}
case " $SKIP " in *" coin "*) COIN_SEEDS="" ;; esac
KINDS="explore purposeful"
H=$OUT/$SPLIT  # the held-out sets and every score on them
LOGS=$OUT/logs
source lab/jobs.sh  # in_parallel
score() {  # score NAME SEED OUT_STEM [eval.py flags]: held-out world-model accuracy on both kinds
    local name=$1 seed=$2 stem=$3 kind; shift 3
    case " $SKIP " in *" $name "*) echo "$name: not scored (SKIP)"; return ;; esac
    mkdir -p "$(dirname "$stem")"
    for kind in $KINDS; do
        f=$H/heldout_$kind/transitions.jsonl
        [ -f "${stem}_$kind.json" ] || $PY eval.py wm --transitions "$f" --eval-max-triplets "$HELDOUT" --seed "$seed" \
            --out "${stem}_$kind.json" "$@"
    done
}

export PY H HELDOUT KINDS SKIP
export -f score
# One queue in dependency order (`after` waits for an earlier job): a seed's runs start once its filter is done
he=heldout_explore_$SPLIT hp=heldout_purposeful_$SPLIT
jobs=("$he $PY train.py collect --seed 0 --split $SPLIT --num-games $HELD_GAMES --out $H/heldout_explore")
for s in $SEEDS; do  # each seed draws its own train games
    jobs+=("collect$s $PY train.py collect --seed $s $COLLECT --out $OUT/seed$s/collect")
done
jobs+=("$hp $PY train.py collect --walkthrough --seed 0 --split $SPLIT --num-games $HELD_GAMES --out $H/heldout_purposeful")
for s in $SEEDS; do
    jobs+=("filter$s after collect$s; $PY train.py filter --transitions $OUT/seed$s/collect/transitions.jsonl --seed $s \
--filter-dir $OUT/seed$s/filter $FLAGS --out $OUT/seed$s/filter")
done
jobs+=("baselines_$SPLIT after $he $hp; for b in template nothing copy; do score \$b 0 $H/baselines/\$b --baseline \$b; done"
       "base_$SPLIT after $he $hp; score base 0 $H/baselines/base")
train=() evals=()
for s in $SEEDS; do
    d=$OUT/seed$s
    run="--transitions $d/collect/transitions.jsonl --seed $s --max-steps $STEPS --filter-dir $d/filter $FLAGS"
    curve=""
    [ "$CURVE_EVERY" -gt 0 ] && curve="--eval-steps $CURVE_EVERY --eval-on-start --eval-max-triplets $CURVE \
--eval-transitions $H/heldout_explore/transitions.jsonl"
    arms=(rwml)
    train+=("rwml$s after filter$s $he; [ -f $d/rwml/adapter/adapter_config.json ] || $PY train.py wm $run $curve --out $d/rwml --resume")
    case " $COIN_SEEDS " in *" $s "*)
        arms+=(coin)
        train+=("coin$s after filter$s $he; [ -f $d/coin/adapter/adapter_config.json ] || $PY train.py wm $run $curve \
--reward-control coin --out $d/coin --resume") ;;
    esac
    case " $VARIANT_SEEDS " in *" $s "*)
        IFS=';' read -ra variants <<< "$VARIANTS"
        for v in "${variants[@]}"; do
            [ -n "${v// }" ] || continue
            a=rwml_${v%%=*} flags=${v#*=}
            flags=${flags//\{d\}/$d}
            arms+=("$a")
            train+=("$a$s after filter$s $he; [ -f $d/$a/adapter/adapter_config.json ] || $PY train.py wm $run $curve $flags \
--out $d/$a --resume")
        done ;;
    esac
    case " $SKIP " in *" wm_sft "*) ;; *)
        arms+=(wm_sft)
        train+=("wm_sft$s after filter$s; [ -f $d/wm_sft/adapter/adapter_config.json ] || $PY train.py wm-sft $run --out $d/wm_sft") ;;
    esac
    train+=("eval_warmup${s}_$SPLIT after filter$s $he $hp; score warmup $s $H/seed$s/eval_warmup --adapter $d/filter/warmup_adapter")
    for a in "${arms[@]}"; do
        evals+=("eval_$a${s}_$SPLIT after $a$s $he $hp; score $a $s $H/seed$s/eval_$a --adapter $d/$a/adapter")
    done
done
in_parallel "${jobs[@]}" "${train[@]}" "${evals[@]}"
$PY lab/reports.py sanity "$OUT" --split "$SPLIT" --out "$OUT/sanity_$SPLIT.md"
study=lab/results/stage1_shipped; [ "$SPLIT" = valid_unseen ] || study=lab/results/stage1_dev_recipe
[ "$OUT" = runs/sanity ] && mkdir -p $study && cp "$OUT/sanity_$SPLIT.md" "$OUT"/sanity_${SPLIT}_curve.png $study/ 2>/dev/null || true

#!/usr/bin/env bash
# dev (valid_seen) levers for issue 53 item 1, seed 0
set -x
export ALFWORLD_DATA=${ALFWORLD_DATA:-~/.cache/alfworld} HF_HUB_OFFLINE=1 OMP_NUM_THREADS=1
PY=.venv/bin/python
arm=$1
case $arm in
  default) $PY train.py --heldout-split valid_seen --seed 0 --no-coin-control --out runs/dev/default ;;
  play05)
    $PY train.py collect --walkthrough --split train --num-games 32 --seed 100 --out runs/dev/more/walk
    $PY train.py collect --explore-prob 0.5 --split train --num-games 32 --seed 100 --out runs/dev/more/play05
    $PY train.py --heldout-split valid_seen --seed 0 --no-coin-control --warmup-games 0 --sft-epochs 1 \
      --warmup-transitions runs/dev/more/walk/transitions.jsonl,runs/dev/more/play05/transitions.jsonl \
      --out runs/dev/play05 ;;
esac
case $arm in
  walk96)
    $PY train.py collect --walkthrough --split train --num-games 96 --seed 200 --out runs/dev/more/walk96
    $PY train.py --heldout-split valid_seen --seed 0 --no-coin-control \
      --warmup-transitions runs/dev/more/walk96/transitions.jsonl --out runs/dev/walk96 ;;
  epochs2) $PY train.py --heldout-split valid_seen --seed 0 --no-coin-control --sft-epochs 2 --out runs/dev/epochs2 ;;
esac
case $arm in
  e2steps40) $PY train.py --heldout-split valid_seen --seed 0 --no-coin-control --sft-epochs 2 --max-steps 40 \
      --filter-dir runs/dev/epochs2/filter --out runs/dev/e2steps40 ;;
esac

#!/usr/bin/env bash
# The same small runs at two commits give identical adapters and metrics.
# Per commit, in its own worktree: collect 3 games' walkthroughs; wm 2 steps on them (the filter, its warm-up,
# RWML; again with a coin for a reward); policy on TextWorld in choose mode, 2 steps. Then every adapter's
# weights (sha256) and every metrics row but its clock fields are compared.       OUT=runs/same bash lab/same_behaviour.sh A B
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PY:-$PWD/.venv/bin/python}
OUT=$(realpath -m "${OUT:-runs/same_behaviour}")
for c in "$1" "$2"; do
    d=$OUT/$c
    [ -d "$d/src" ] || git worktree add -f --detach "$d/src" "$c" >/dev/null
    (cd "$d/src"
     export OMP_NUM_THREADS=1
     [ -f "$d/collect/transitions.jsonl" ] || $PY train.py collect --walkthrough --num-games 3 --out "$d/collect"
     [ -f "$d/wm/adapter/adapter_model.safetensors" ] || $PY train.py wm --max-steps 2 --out "$d/wm" \
         --transitions "$d/collect/transitions.jsonl"
     # a coin for a reward: every step's groups carry a gradient (2 steps of the real reward on 3 games may all
     # score 0, leaving the adapter its warm-up's)
     [ -f "$d/wm_coin/adapter/adapter_model.safetensors" ] || $PY train.py wm --max-steps 2 --out "$d/wm_coin" \
         --transitions "$d/collect/transitions.jsonl" --filter-dir "$d/wm/filter" --reward-control coin
     [ -f "$d/policy/adapter/adapter_model.safetensors" ] || $PY train.py policy --env textworld \
         --action-mode choose --max-steps 2 --out "$d/policy") > "$d.log" 2>&1
done
$PY - "$OUT/$1" "$OUT/$2" <<'PY'
import hashlib, json, sys
from pathlib import Path
a, b = (Path(x) for x in sys.argv[1:])
clock = ("time", "second", "sec", "tokens_per", "rss", "gb")  # how long and how big: the machine's, not the run's
def rows(f):
    return [{k: v for k, v in json.loads(x).items() if not any(c in k for c in clock)} for x in f.read_text().splitlines()]
same = True
for f in sorted(a.rglob("*")):
    g = b / f.relative_to(a)
    if "src" in f.parts or not f.is_file():
        continue
    if f.suffix == ".safetensors":
        h = [hashlib.sha256(x.read_bytes()).hexdigest()[:12] if x.exists() else None for x in (f, g)]
        print(f"{'same' if h[0] == h[1] else 'DIFFERENT'} weights  {f.relative_to(a)} {h[0]} {h[1]}")
        same &= h[0] == h[1]
    elif f.name in ("metrics.jsonl", "transitions.jsonl", "kept.jsonl", "easiness.jsonl"):
        ok = g.exists() and rows(f) == rows(g)
        print(f"{'same' if ok else 'DIFFERENT'} rows     {f.relative_to(a)} ({len(rows(f))})")
        same &= ok
print("identical adapters and metrics" if same else "NOT identical")
sys.exit(0 if same else 1)
PY

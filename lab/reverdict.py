"""Which printed verdicts no longer hold: every "<diff> [lo, hi] holds|reversed ... sign-flip over games p X"
statement in lab/results (run logs, tables, READMEs), README.md and lab/NOTEBOOK.md whose exact sign-flip test
over games gives p >= 0.05. Such a statement was printed under the old rule (the CI alone); under today's
(readout/stats.py: the CI excludes 0 and the sign-flip test agrees, p < 0.05) it reads "no difference
detected". Run logs are printouts of past runs and are not rewritten: this list is what they say that no
longer holds.

    python lab/reverdict.py [--out lab/results/reverdict.md]
"""
from __future__ import annotations

import argparse
import re
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
NUM = r"[+\-−]?\d+\.\d+"
CLAIM = re.compile(rf"({NUM}) \[({NUM}), ({NUM})\] (holds|reversed)")
INTERVAL = re.compile(rf"{NUM} \[{NUM}, {NUM}\]")
COUNTS = re.compile(r"(\d+) up, (\d+) down")
SIGN_FLIP = re.compile(r"sign-flip (?:test )?(?:over games )?p (\d+\.\d+)")
SUFFIXES = (".md", ".txt")
ALPHA = 0.05


def sources() -> list[Path]:
    """README.md, lab/NOTEBOOK.md and every Markdown or text file under lab/results, in a fixed order."""
    found = [p for p in sorted((ROOT / "lab" / "results").rglob("*")) if p.suffix in SUFFIXES and p.is_file()]
    return [ROOT / "README.md", ROOT / "lab" / "NOTEBOOK.md"] + [p for p in found
                                                                  if p.name != "reverdict.md"]


def claims(line: str):
    """Each holds / reversed statement of a line with its sign-flip p over games (those that print one):
    (context, statement, p). The test is read between the statement and the next interval of the line."""
    for m in CLAIM.finditer(line):
        nxt = INTERVAL.search(line, m.end())
        tail = line[m.end():nxt.start() if nxt else len(line)]
        p = SIGN_FLIP.search(tail)
        if not p:
            continue
        counts = COUNTS.search(tail)
        moved = f"; {counts[1]} up, {counts[2]} down" if counts else ""
        first = INTERVAL.search(line)
        label = re.sub(r"\s+", " ", line[:first.start()]).lstrip(" |").rstrip(" |;:,(")
        label = ("…" + label[-80:].split(" ", 1)[-1]) if len(label) > 80 else label
        if first.start() < m.start():  # a later statement of the line: the words just before it too
            label += " … " + line[:m.start()].rsplit(";", 1)[-1].strip(" |;:,(")
        context = label
        yield context, f"{m[1]} [{m[2]}, {m[3]}] {m[4]}{moved}", float(p[1])


def scan() -> tuple[list[dict], int]:
    """The statements whose p >= ALPHA, each once with every place it is printed, and how many distinct
    statements were read."""
    seen, failing = set(), {}
    for path in sources():
        rel = path.relative_to(ROOT).as_posix()
        for number, line in enumerate(path.read_text(errors="replace").splitlines(), 1):
            for context, statement, p in claims(line):
                key = (statement, p)
                seen.add(key)
                if p >= ALPHA:
                    row = failing.setdefault(key, dict(statement=statement, p=p, context=context, where=[]))
                    if f"{rel}:{number}" not in row["where"]:
                        row["where"].append(f"{rel}:{number}")
    return list(failing.values()), len(seen)


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", type=Path, help="write the list here (Markdown) as well as printing it")
    args = ap.parse_args(argv)
    rows, total = scan()
    lines = ["`python lab/reverdict.py --out lab/results/reverdict.md`", "",
             f"{len(rows)} of {total} distinct holds / reversed statements printed with a sign-flip test "
             f"over games have p >= {ALPHA}: under today's rule (the 95 % CI excludes 0 and the sign-flip "
             "test agrees, readout/stats.py) each is \"no difference detected\". A statement is its "
             "difference, CI, verdict, items moved and p; each is listed once, with the first place's "
             "context and every place it is printed (run logs are printouts of past runs and stay as they "
             "are).", "",
             "| statement | p | context (first place) | where |", "|---|---|---|---|"]
    for r in rows:
        more = len(r["where"]) - 6
        where = ", ".join(r["where"][:6]) + (f" and {more} more" if more > 0 else "")
        lines.append(f"| {r['statement']} | {r['p']:.3f} | {r['context'].replace('|', '/')} | {where} |")
    text = "\n".join(lines) + "\n"
    print(text, end="")
    if args.out:
        args.out.write_text(text)


if __name__ == "__main__":
    sys.exit(main())

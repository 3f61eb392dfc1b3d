"""Support (skip on a first read): one update: its data, the optimizer step, and log pi of completions, fast.

An update's `Batch` and its micro-batches, the optimizer step, and log pi computed fast (chunked vocabulary
projection, shared-prompt forward), each fast path checked once per model against the model's own full
logits (`full_logprobs`); rwml.logprobs defines log pi plainly, and the tests hold every path to it
(`batch_logprobs`: the one a GRPO update calls). The update's diagnostics (`loss_stats`: TRL's kl, clip
ratio). SFT's packing too. Below the engine: it imports nothing of it."""
from __future__ import annotations

import math
import weakref
from dataclasses import dataclass, fields, replace

import torch
from torch.utils.checkpoint import checkpoint



def pack(prompts: list[list[int]], completions: list[list[int]], pad_token_id: int):
    """Token lists -> (input_ids, attention_mask, completion_mask): [left-padded prompt | completion] rows."""
    P, C = max(map(len, prompts)), max(max(map(len, completions)), 1)
    ids = torch.full((len(prompts), P + C), pad_token_id)
    attn = torch.zeros_like(ids)
    cmask = torch.zeros(len(prompts), C, dtype=torch.long)
    for j, (p, c) in enumerate(zip(prompts, completions)):
        ids[j, P - len(p):P] = torch.tensor(p, dtype=torch.long)
        ids[j, P:P + len(c)] = torch.tensor(c, dtype=torch.long)
        attn[j, P - len(p):P + len(c)] = 1
        cmask[j, :len(c)] = 1
    return ids, attn, cmask


def token_micro_batches(rows: list[tuple[list[int], list[int]]], max_tokens: int) -> list[list[tuple]]:
    """(prompt ids, completion ids) rows -> micro-batches of similar lengths whose padded size (`pack`) stays
    within `max_tokens` (a longer row goes alone): activation memory follows padded tokens, not rows."""
    out, cur, P, C = [], [], 0, 0
    for r in sorted(rows, key=lambda r: (len(r[0]), len(r[1]))):
        p, c = max(P, len(r[0])), max(C, len(r[1]))
        if cur and (len(cur) + 1) * (p + c) > max_tokens:
            out.append(cur)
            cur, p, c = [], len(r[0]), len(r[1])
        cur.append(r)
        P, C = p, c
    return out + [cur] if cur else out


def bare_model(model):
    """The transformers model under a peft wrapper (the model itself when there is none)."""
    return model.get_base_model() if hasattr(model, "get_base_model") else model


def position_ids_from(attention_mask: torch.Tensor) -> torch.Tensor:
    """Positions of left-padded rows: each row's text starts at 0 (padding sits at 0 too, masked)."""
    return (attention_mask.cumsum(-1) - 1).clamp(min=0)


def optimizer_step(model, optimizer, max_grad_norm: float, parts: list[dict] | None) -> dict:
    """Clip and step after the micro-batches' backward (`parts`: their statistics; None when a loss was not
    finite); the update's statistics, token-weighted."""
    params = [p for p in model.parameters() if p.requires_grad]
    grad_norm = float("nan") if parts is None else float(torch.nn.utils.clip_grad_norm_(params,
                                                                                         max_grad_norm))
    ok = math.isfinite(grad_norm)
    if ok:
        optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    parts = parts or []
    tokens = max(sum(p["tokens"] for p in parts), 1)
    return dict(loss=sum(p["loss"] for p in parts) if ok else float("nan"),
                kl=sum(p["kl"] * p["tokens"] for p in parts) / tokens,
                clip_ratio=sum(p["clip_ratio"] * p["tokens"] for p in parts) / tokens, grad_norm=grad_norm,
                skipped=not ok)


# ------------------------------------------------------------------ one update's data, and log pi plainly

@dataclass
class Batch:
    """One GRPO update's data (`rwml.grpo_update`): per row a sampled completion, its advantage, its tokens'
    loss weights (`rwml.token_weights`). Tensors are [B, ...]; a group's rows are next to each other. (Choose
    mode's rows are a turn's choice each: choose.ChoiceBatch.)"""
    input_ids: torch.Tensor  # [B, P + C]: the left-padded prompt, then the completion
    attention_mask: torch.Tensor  # [B, P + C]
    completion_mask: torch.Tensor  # [B, C]: 1 on the sampled tokens
    advantages: torch.Tensor  # [B]
    weights: torch.Tensor  # [B, C]
    prompt_ids: torch.Tensor | None = None  # [B / G, P]: each group's prompt once (its forward is shared)
    prompt_mask: torch.Tensor | None = None
    group_size: int = 1  # G when prompt_ids is set


def full_logprobs(model, input_ids: torch.Tensor, attention_mask: torch.Tensor, completion_mask: torch.Tensor,
                  *, temperature: float = 1.0) -> torch.Tensor:
    """rwml.logprobs (the definition; support imports nothing from the five, tests/test_grpo.py holds the two
    equal): a model's path where its shortcuts disagree, and what `fast_paths` checks them against."""
    C = completion_mask.shape[1]
    logits = model(input_ids=input_ids, attention_mask=attention_mask,
                   position_ids=position_ids_from(attention_mask), logits_to_keep=C + 1).logits[:, :-1]
    return (logits.float() / temperature).log_softmax(-1).gather(-1, input_ids[:, -C:, None]).squeeze(-1) \
        * completion_mask


def to_device(batch: Batch, device) -> Batch:
    """The one place a batch meets the model's device (rewards, advantages, weights: built on the CPU)."""
    return replace(batch, **{f.name: v.to(device) for f in fields(batch)
                             if torch.is_tensor(v := getattr(batch, f.name))})


def micro_batches(batch: Batch, size: int, max_tokens: int = 0) -> list[Batch]:
    """Consecutive slices of whole groups: at most `size` rows and, with `max_tokens`, at most that many
    padded tokens in the forward (shared prompt: groups x (prompt + G completions), else rows x (prompt +
    completion)), after each slice drops its all-padding columns; a group that needs more goes alone."""
    G, B = batch.group_size, len(batch.input_ids)
    C = batch.completion_mask.shape[1]
    P = batch.input_ids.shape[1] - C
    plen, clen = batch.attention_mask[:, :P].sum(1).tolist(), batch.completion_mask.sum(1).tolist()
    rows_cap = G * max(1, size // G)
    bounds, start, wp, wc = [], 0, 0, 0
    for g in range(0, B, G):
        p, c = max(wp, *plen[g:g + G]), max(wc, *clen[g:g + G])
        rows = g + G - start
        tokens = rows // G * (p + G * c) if G > 1 else rows * (p + c)
        if g > start and (rows > rows_cap or 0 < max_tokens < tokens):
            bounds.append((start, g))
            start, p, c = g, max(plen[g:g + G]), max(clen[g:g + G])
        wp, wc = p, c
    bounds.append((start, B))
    return [_trimmed(batch, i, j, G, P) for i, j in bounds]


def _trimmed(batch: Batch, i: int, j: int, G: int, P: int) -> Batch:
    """Rows i:j of `batch` without their all-padding prompt and completion columns."""
    attn, cmask = batch.attention_mask[i:j], batch.completion_mask[i:j]
    lead = P - int(attn[:, :P].sum(1).max())  # prompt columns that are all padding
    keep_c = max(int(cmask.sum(1).max()), 1)
    mb = replace(batch, input_ids=batch.input_ids[i:j, lead:P + keep_c],
                 attention_mask=attn[:, lead:P + keep_c], completion_mask=cmask[:, :keep_c],
                 weights=batch.weights[i:j, :keep_c], advantages=batch.advantages[i:j])
    if G > 1:
        mb = replace(mb, prompt_ids=batch.prompt_ids[i // G:j // G, lead:],
                     prompt_mask=batch.prompt_mask[i // G:j // G, lead:])
    return mb


# Two shortcuts (our own chunked projection, a prompt's key/value cache shared by its group), checked once
# per model against its own full logits (`fast_paths`); one that disagrees gives way to the plain path.
def _chunk_logps(hidden, weight, bias, targets, temperature, softcap):
    logits = torch.nn.functional.linear(hidden, weight, bias)
    if softcap:  # Gemma 2's final-logit soft-capping, in the head's dtype as its own forward does it
        logits = torch.tanh(logits / softcap) * softcap
    logits = logits.float() / temperature
    return logits.gather(-1, targets.unsqueeze(-1)).squeeze(-1) - logits.logsumexp(-1)


def completion_logprobs(model, input_ids: torch.Tensor, attention_mask: torch.Tensor,
                        completion_mask: torch.Tensor, *, temperature: float = 1.0,
                        chunk_size: int = 512) -> torch.Tensor:
    """log pi(token) of the completion tokens ([B, C]; 0 where completion_mask is 0) of [left-padded prompt
    | completion] rows: the projection runs on `chunk_size` tokens at a time, recomputed in backward, so
    vocabulary-sized logits never exist for the whole batch. Where `fast_paths` says no: `full_logprobs`."""
    if not fast_paths(model).head:
        return full_logprobs(model, input_ids, attention_mask, completion_mask, temperature=temperature)
    return _decoder_logprobs(model, input_ids, attention_mask, completion_mask, temperature, chunk_size)


def _decoder_logprobs(model, input_ids, attention_mask, completion_mask, temperature, chunk_size):
    base = bare_model(model)
    hidden = base.get_decoder()(input_ids=input_ids, attention_mask=attention_mask,
                                position_ids=position_ids_from(attention_mask)).last_hidden_state
    C = completion_mask.shape[1]
    return _head_logprobs(base, hidden[:, -C - 1:-1], input_ids[:, -C:], completion_mask, temperature,
                          chunk_size)


def _head_logprobs(base, hidden, targets, completion_mask, temperature, chunk_size):
    """hidden [B, C, H]: the states that predict targets [B, C]; log-probs where completion_mask is 1."""
    keep = completion_mask.bool()
    h, targets = hidden[keep], targets[keep]
    head = base.get_output_embeddings()
    softcap = getattr(base.config.get_text_config(), "final_logit_softcapping", None)
    parts = []
    for i in range(0, h.shape[0], chunk_size):
        args = (h[i:i + chunk_size], head.weight, head.bias, targets[i:i + chunk_size], temperature, softcap)
        grad = torch.is_grad_enabled()  # then the chunk's logits are recomputed in backward, not kept
        parts.append(checkpoint(_chunk_logps, *args, use_reentrant=False) if grad else _chunk_logps(*args))
    out = torch.zeros(completion_mask.shape, dtype=torch.float32, device=hidden.device)
    out[keep] = torch.cat(parts) if parts else out.new_zeros(0)
    return out


def group_logprobs(model, prompt_ids: torch.Tensor, prompt_mask: torch.Tensor, completion_ids: torch.Tensor,
                   completion_mask: torch.Tensor, *, temperature: float = 1.0,
                   chunk_size: int = 512) -> torch.Tensor:
    """`completion_logprobs` for groups: the n completions of a prompt share one forward of it, whose
    key/value cache (and autograd graph) is repeated n times: (P + nC) / n(P + C) of the decoder work. Where
    a shortcut is off (`fast_paths`) or gradient checkpointing drops the cache: whole rows."""
    fast = fast_paths(model)
    checkpointing = (model.training and torch.is_grad_enabled()
                     and bare_model(model).is_activation_checkpointing)
    if not (fast.head and fast.shared_prompt) or checkpointing:
        n = completion_ids.shape[0] // prompt_ids.shape[0]
        ids = torch.cat([prompt_ids.repeat_interleave(n, 0), completion_ids], 1)
        mask = torch.cat([prompt_mask.repeat_interleave(n, 0), completion_mask], 1)
        return completion_logprobs(model, ids, mask, completion_mask, temperature=temperature,
                                   chunk_size=chunk_size)
    return _shared_prompt_logprobs(model, prompt_ids, prompt_mask, completion_ids, completion_mask,
                                   temperature, chunk_size)


def _shared_prompt_logprobs(model, prompt_ids, prompt_mask, completion_ids, completion_mask, temperature,
                            chunk_size):
    base = bare_model(model)
    decoder, n = base.get_decoder(), completion_ids.shape[0] // prompt_ids.shape[0]
    position_ids = position_ids_from(prompt_mask)
    out = decoder(input_ids=prompt_ids, attention_mask=prompt_mask, position_ids=position_ids, use_cache=True)
    out.cache.batch_repeat_interleave(n)
    mask = torch.cat([prompt_mask.repeat_interleave(n, 0), completion_mask], 1)
    start = prompt_mask.sum(-1, keepdim=True).repeat_interleave(n, 0)  # positions continue the prompt's
    C = completion_ids.shape[1]
    hidden = decoder(input_ids=completion_ids, attention_mask=mask, cache=out.cache, use_cache=True,
                     position_ids=start + torch.arange(C, device=start.device)).last_hidden_state
    # the prompt's last state predicts the first completion token; completion states predict the rest
    states = torch.cat([out.last_hidden_state[:, -1:].repeat_interleave(n, 0), hidden[:, :-1]], 1)
    return _head_logprobs(base, states, completion_ids, completion_mask, temperature, chunk_size)


@dataclass(frozen=True)
class FastPaths:
    head: bool  # log-probs from the decoder's states through our own chunked projection (`_head_logprobs`)
    shared_prompt: bool  # a group's completions on their prompt's repeated key/value cache (training, sample)


_FAST_PATHS = weakref.WeakKeyDictionary()  # base model -> FastPaths
_SAID: set[str] = set()


def fast_paths(model) -> FastPaths:
    """Which shortcuts this model's log-probs and samples may take, checked once per model on a few tokens
    against its own full logits; one that disagrees gives way to the plain path, said once in the log."""
    base = bare_model(model)
    if base not in _FAST_PATHS:
        _FAST_PATHS[base] = _probe_fast_paths(model, base)
    return _FAST_PATHS[base]


@torch.no_grad()
def _probe_fast_paths(model, base) -> FastPaths:
    vocab = base.get_output_embeddings().weight.shape[0]
    ids = (torch.arange(1, 13, device=base.device) * 7919 % vocab).repeat(2, 1)  # 12 arbitrary tokens, twice
    attn, cmask, P = torch.ones_like(ids), torch.ones_like(ids[:, 8:]), 8
    attn[1, :3] = 0  # the second row left-padded
    # half precision rounds a cached forward apart: a looser bound (a missing soft-cap moves whole nats)
    tol = 1e-3 if base.get_output_embeddings().weight.dtype == torch.float32 else 0.1
    training = model.training
    model.eval()  # no dropout: both paths must compute the same function
    try:
        want = full_logprobs(model, ids, attn, cmask)
        ours, head = _check(_decoder_logprobs, (model, ids, attn, cmask, 1.0, 512), want, tol)
        group = (model, ids[:, :P], attn[:, :P], ids[:, P:].repeat_interleave(2, 0),
                 cmask.repeat_interleave(2, 0), 1.0, 512)  # each prompt's completion twice
        # the cache against the same projection without it: sampling's shared prefill needs only the cache
        ref = (want if ours is None else ours).repeat_interleave(2, 0)
        _, shared = _check(_shared_prompt_logprobs, group, ref, tol)
    finally:
        model.train(training)
    name = type(base).__name__
    for key, why, what in ((" head", head, "log-probs from its own full logits (slower, more memory): our "
                                           "chunked projection"),
                           (" cache", shared, "no shared prompt cache (sampling prefills every copy, a "
                                              "group's completions run on whole rows): its repeat")):
        if why and name + key not in _SAID:
            _SAID.add(name + key)
            print(f"rwml: {name}: {what} gives other numbers ({why})", flush=True)
    return FastPaths(head=not head, shared_prompt=not shared)


def _check(fn, args, want, tol) -> tuple[torch.Tensor | None, str | None]:
    """(fn(*args), None) when that gives `want` to within `tol`, else (its output or None, why not)."""
    try:
        got = fn(*args)
    except Exception as e:  # noqa: BLE001 -- a shortcut that fails in any way: the plain path
        return None, f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"
    err = (got - want).abs().max().item()
    return got, None if err <= tol else f"log-probs differ by up to {err:.3g}"


def completion_mask_from(completion_ids: torch.Tensor, eos_token_id, pad_token_id=None,
                         ends: torch.Tensor | None = None) -> torch.Tensor:
    """1 on the sampled tokens: up to and including the first end-of-turn token or stop-string end (`ends`,
    [B, C] bool); 0 after. Not `ids != pad`: SmolLM2's pad *is* its eos, and generate pads stopped rows."""
    eos_ids = eos_token_id if isinstance(eos_token_id, (list, tuple)) else [eos_token_id]
    is_end = torch.isin(completion_ids, torch.tensor(eos_ids, device=completion_ids.device))
    if ends is not None:
        is_end = is_end | ends.to(is_end.device)
    mask = ~((is_end.cumsum(1) - is_end.long()) > 0)  # not strictly after the first end
    if pad_token_id is not None and pad_token_id not in eos_ids:
        mask &= completion_ids != pad_token_id
    return mask.long()


def batch_logprobs(model, mb: Batch, cfg) -> torch.Tensor:
    """rwml.logprobs of a micro-batch's completion tokens ([B, C]), computed faster: each group's prompt once
    (`group_logprobs`), or every row whole in chunks of the vocabulary projection (`completion_logprobs`);
    each shortcut checked once per model against the model's full logits (`fast_paths`), which give way to
    them where they disagree."""
    ids, cmask = mb.input_ids, mb.completion_mask
    if mb.group_size > 1:
        completions = ids[:, ids.shape[1] - cmask.shape[1]:]
        return group_logprobs(model, mb.prompt_ids, mb.prompt_mask, completions, cmask,
                              temperature=cfg.temperature, chunk_size=cfg.logits_chunk_size)
    return completion_logprobs(model, ids, mb.attention_mask, cmask, temperature=cfg.temperature,
                               chunk_size=cfg.logits_chunk_size)


@torch.no_grad()
def loss_stats(logp, old_logp, kl, advantages, weights, epsilon: float = 0.2,
               epsilon_high: float | None = None) -> dict:
    """An update's diagnostics over its live tokens, TRL's: the mean of `kl` (rwml.kl_k3 per token; None: no
    KL term) and the clip ratio: a token counts as clipped when the clipped term wins, i.e. its ratio left
    [1 - eps, 1 + eps_high] in the direction its advantage pushes."""
    ratio, a, live = torch.exp(logp - old_logp), advantages.unsqueeze(1), (weights > 0).float()
    high = 1 + (epsilon if epsilon_high is None else epsilon_high)
    clipped = ((ratio < 1 - epsilon) & (a < 0)) | ((ratio > high) & (a > 0))
    kl = torch.zeros_like(logp) if kl is None else kl
    n = live.sum().clamp(min=1)
    return dict(kl=float((kl * live).sum() / n), clip_ratio=float((clipped.float() * live).sum() / n))

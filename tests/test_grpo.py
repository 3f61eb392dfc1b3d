"""GRPO maths against hand-computed values, the log-prob path against a naive one, the easy filter."""
import math

import pytest
import torch

import rwml

# ------------------------------------------------------------------ advantages


def test_group_advantages_by_hand():
    r = torch.tensor([1.0, 0, 0, 1, 1, 1, 1, 1])
    s = math.sqrt(1 / 3)  # unbiased std of (1, 0, 0, 1)
    expect = torch.tensor([0.5, -0.5, -0.5, 0.5, 0, 0, 0, 0]) / (s + 1e-4)
    assert torch.allclose(rwml.group_advantages(r, 4, "group"), expect, atol=1e-6)
    batch_std = math.sqrt((6 * 0.25 ** 2 + 2 * 0.75 ** 2) / 7)
    assert torch.allclose(rwml.group_advantages(r, 4, "batch"),
                          torch.tensor([0.5, -0.5, -0.5, 0.5, 0, 0, 0, 0]) / (batch_std + 1e-4), atol=1e-6)
    assert torch.equal(rwml.group_advantages(r, 4, "none"), torch.tensor([0.5, -0.5, -0.5, 0.5, 0, 0, 0, 0]))


# ------------------------------------------------------------------ loss for each loss_type

MASK = torch.tensor([[1, 1, 0], [1, 1, 1]])
ADV = torch.tensor([1.0, -2.0])


@pytest.mark.parametrize("loss_type, expect", [
    ("grpo", (-1 + 2) / 2),             # per-sequence means (-1, +2), then their mean
    ("dapo", (-1 * 2 + 2 * 3) / 5),     # one mean over the batch's 5 tokens
    ("dr_grpo", (-1 * 2 + 2 * 3) / (2 * 4)),  # sum / (sequences x max_completion_length=4)
])
def test_loss_types_by_hand(loss_type, expect):
    logp = torch.zeros(2, 3)
    w = rwml.token_weights(MASK, loss_type, max_completion_length=4)
    loss, stats = rwml.grpo_loss(logp, logp, None, ADV, w)  # ratio 1: loss = -A per token
    assert loss.item() == pytest.approx(expect)
    assert stats["clip_ratio"] == 0.0 and stats["kl"] == 0.0


def test_clipping_by_hand():
    one = torch.ones(1, 1)
    w = rwml.token_weights(one, "grpo", 1)
    up, down = torch.log(torch.tensor([[1.5]])), torch.log(torch.tensor([[0.5]]))
    zero = torch.zeros(1, 1)
    # A > 0, ratio 1.5: clipped to 1.2 -> -1.2 A ; with epsilon_high 0.28 -> -1.28 A
    assert rwml.grpo_loss(up, zero, None, torch.tensor([2.0]), w)[0].item() == pytest.approx(-2.4)
    assert rwml.grpo_loss(up, zero, None, torch.tensor([2.0]), w, epsilon_high=0.28)[0].item() == pytest.approx(-2.56)
    # A < 0, ratio 1.5: the unclipped term is the smaller one -> -1.5 A
    assert rwml.grpo_loss(up, zero, None, torch.tensor([-2.0]), w)[0].item() == pytest.approx(3.0)
    # A < 0, ratio 0.5: clipped to 0.8 -> -0.8 A
    loss, stats = rwml.grpo_loss(down, zero, None, torch.tensor([-2.0]), w)
    assert loss.item() == pytest.approx(1.6) and stats["clip_ratio"] == 1.0


def test_k3_kl_by_hand():
    logp, ref = torch.zeros(1, 1), torch.log(torch.tensor([[2.0]]))
    w = rwml.token_weights(torch.ones(1, 1), "grpo", 1)
    loss, stats = rwml.grpo_loss(logp, logp, ref, torch.tensor([0.0]), w, beta=0.5)
    k3 = 2.0 - math.log(2.0) - 1
    assert stats["kl"] == pytest.approx(k3) and loss.item() == pytest.approx(0.5 * k3)


def test_completion_mask_from_first_eos():
    ids = torch.tensor([[5, 6, 9, 9, 9], [5, 6, 7, 8, 4], [9, 1, 9, 2, 3]])
    assert rwml.completion_mask_from(ids, 9).tolist() == [[1, 1, 1, 0, 0], [1, 1, 1, 1, 1], [1, 0, 0, 0, 0]]


# ------------------------------------------------------------------ log-probs on a real (tiny) model

@pytest.fixture(scope="module")
def tiny(tiny_model):
    model, tok = rwml.load_model(tiny_model)
    return rwml.add_lora(model, r=4, alpha=8), tok


def rollout(model, tok, n=4, length=12):
    torch.manual_seed(0)
    return rwml.sample_group(model, tok, ["go to desk 1", "open the drawer 2 please"], num_generations=n // 2,
                             max_completion_length=length)


def naive_logprobs(model, ids, attn, cmask):
    """What the chunked path replaces: full logits for every position, then log_softmax."""
    pos = (attn.cumsum(-1) - 1).clamp(min=0)
    logits = model(input_ids=ids, attention_mask=attn, position_ids=pos).logits
    C = cmask.shape[1]
    lp = logits[:, -C - 1:-1].float().log_softmax(-1).gather(-1, ids[:, -C:, None]).squeeze(-1)
    return lp * cmask


def test_chunked_logprobs_and_gradients_match_naive(tiny):
    model, tok = tiny
    with torch.no_grad():  # give the adapter non-zero weights so that gradients reach every LoRA matrix
        for n, p in model.named_parameters():
            if "lora_B" in n:
                p.normal_(0, 0.02)
    roll = rollout(model, tok)
    ids, attn, cmask = roll["input_ids"], roll["attention_mask"], roll["completion_mask"]
    adv = torch.tensor([1.0, -1.0, 0.5, -0.5])
    grads = []
    for fn in (lambda: rwml.completion_logprobs(model, ids, attn, cmask, chunk_size=5), lambda: naive_logprobs(model, ids, attn, cmask)):
        model.zero_grad()
        lp = fn()
        w = rwml.token_weights(cmask, "grpo", 12)
        loss, _ = rwml.grpo_loss(lp, lp.detach(), None, adv, w)
        loss.backward()
        grads.append((lp.detach(), {n: p.grad.clone() for n, p in model.named_parameters() if p.requires_grad}))
    (lp_a, g_a), (lp_b, g_b) = grads
    assert torch.allclose(lp_a, lp_b, atol=1e-5)
    assert (lp_a[cmask.bool()] < 0).all() and (lp_a[~cmask.bool()] == 0).all()
    for n in g_a:
        assert torch.allclose(g_a[n], g_b[n], atol=1e-6, rtol=1e-4), n
    assert any(g.abs().sum() > 0 for g in g_a.values())


def test_shared_prompt_forward_matches_naive_logprobs_and_gradients(tiny):
    """group_logprobs runs each prompt once and reuses its key/value cache for the group's completions;
    log-probs and LoRA gradients (which flow through that cache) equal the naive full-logits path."""
    model, tok = tiny
    with torch.no_grad():
        for n, p in model.named_parameters():
            if "lora_B" in n:
                p.normal_(0, 0.02)
    torch.manual_seed(1)
    roll = rwml.sample_group(model, tok, ["go to desk 1", "open the drawer 2 please", "look"], num_generations=3,
                             max_completion_length=10)
    ids, attn, cmask = roll["input_ids"], roll["attention_mask"], roll["completion_mask"]
    P = ids.shape[1] - cmask.shape[1]
    assert (attn[:, :P] == 0).any()  # prompts of different lengths: left padding is exercised
    adv = torch.linspace(-1, 1, ids.shape[0])
    w = rwml.token_weights(cmask, "grpo", 10)
    grads = []
    for fn in (lambda: rwml.group_logprobs(model, ids[::3, :P], attn[::3, :P], ids[:, P:], cmask, chunk_size=7),
               lambda: naive_logprobs(model, ids, attn, cmask)):
        model.zero_grad()
        lp = fn()
        loss, _ = rwml.grpo_loss(lp, lp.detach(), None, adv, w)
        loss.backward()
        grads.append((lp.detach(), {n: p.grad.clone() for n, p in model.named_parameters() if p.requires_grad}))
    (lp_a, g_a), (lp_b, g_b) = grads
    assert torch.allclose(lp_a, lp_b, atol=1e-5)
    for n in g_a:
        assert torch.allclose(g_a[n], g_b[n], atol=1e-6, rtol=1e-4), n
    assert all(g_a[n].abs().sum() > 0 for n in g_a if "lora_A" in n and "k_proj" in n)  # k, v: through the cache


def test_kl_is_zero_when_the_adapter_equals_the_reference(tiny_model):
    model, tok = rwml.load_model(tiny_model)
    model = rwml.add_lora(model, r=4, alpha=8)  # fresh LoRA: B = 0, so the policy is the base model
    roll = rollout(model, tok)
    args = (roll["input_ids"], roll["attention_mask"], roll["completion_mask"])
    with torch.no_grad():
        logp = rwml.completion_logprobs(model, *args)
        with model.disable_adapter():
            ref = rwml.completion_logprobs(model, *args)
    w = rwml.token_weights(roll["completion_mask"], "grpo", 12)
    loss, stats = rwml.grpo_loss(logp, logp, ref, torch.zeros(4), w, beta=0.1)
    assert stats["kl"] == 0.0 and loss.item() == 0.0


# ------------------------------------------------------------------ the easy filter's keep rule

def test_easy_filter_marks_the_easiest_share_and_keeps_a_tenth():
    scores = [i / 1000 for i in range(1, 10001)]  # all distinct, all > 0
    keep, easy, tau = rwml.easy_subsample(scores, easy_share=0.3, keep_prob=0.1, seed=0)
    assert sum(easy) == 3000 and all(easy[i] == (scores[i] >= tau) for i in range(len(scores)))
    assert tau == pytest.approx(7.001)
    assert all(k for k, e in zip(keep, easy) if not e)  # every non-easy triplet is kept
    kept_easy = sum(k for k, e in zip(keep, easy) if e)
    assert 240 <= kept_easy <= 360  # ~ Binomial(3000, 0.1): mean 300, sd 16


def test_easy_filter_never_calls_a_zero_easy_and_breaks_ties_at_random():
    scores = [1.0] * 10 + [0.0] * 90
    keep, easy, tau = rwml.easy_subsample(scores, 0.3, 0.1, seed=1)
    assert sum(easy) == 10 and tau == 1.0  # only 10 have easiness > 0, though 30 % would be 30
    scores = [0.5] * 100  # all tied: exactly 30 are picked
    keep, easy, _ = rwml.easy_subsample(scores, 0.3, 0.1, seed=1)
    assert sum(easy) == 30
    assert easy != rwml.easy_subsample(scores, 0.3, 0.1, seed=2)[1]


def test_split_is_ninety_ten_and_disjoint():
    trips = [dict(i=i) for i in range(50)]
    train, held = rwml.split_triplets(trips, 0.1, seed=0)
    assert len(train) == 45 and len(held) == 5
    assert sorted(t["i"] for t in train + held) == list(range(50))


def test_shared_prefill_gives_the_same_tokens_as_plain_generate(tiny_model):
    model, tok = rwml.load_model(tiny_model)
    texts = [rwml.chat(tok, "go to desk 1"), rwml.chat(tok, "a much longer prompt: open the drawer 2, then look")]
    plain = tok(texts, return_tensors="pt", padding=True, add_special_tokens=False)
    repeated = tok([t for t in texts for _ in range(3)], return_tensors="pt", padding=True, add_special_tokens=False)
    ref = model.generate(**repeated, max_new_tokens=10, do_sample=False, pad_token_id=tok.pad_token_id)
    _, shared = rwml.generate_ids(model, tok, texts, 3, max_new_tokens=10, do_sample=False)
    assert torch.equal(shared, ref)
    torch.manual_seed(0)  # sampling: n different continuations per prompt, prompts kept in place
    batch, out = rwml.generate_ids(model, tok, texts, 3, max_new_tokens=10, do_sample=True, temperature=1.0)
    assert out.shape[0] == 6 and torch.equal(out[:, :plain["input_ids"].shape[1]], plain["input_ids"].repeat_interleave(3, 0))
    assert len({tuple(r) for r in out[:3, -10:].tolist()}) > 1

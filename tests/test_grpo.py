"""GRPO maths against hand-computed values, the log-prob path against a naive one, the easy filter."""
import math

import pytest
import torch

import engine
import envs
import rwml
import train
from stages import runs
from stages.settings import GRPOConfig

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


def test_nothing_by_group_counts_the_answer_and_the_advantage_it_got():
    """The drift diagnostic: per group, how many predictions are exactly "Nothing happens." and the advantage
    summed over them (a wrong one in a group with right answers is pushed down; unparseable ones count
    not)."""
    # group 1: target an arrival
    states = ["Nothing happens.", "You arrive at desk 1.", None, "Nothing happens",
              "Nothing happens.", "Nothing happens.", "You open the drawer 1.", "Nothing happens."]
    adv = torch.tensor([-1.0, 1.0, -0.5, 0.5, 0.25, 0.25, -0.75, 0.25])
    out = runs.nothing_by_group(states, adv, 4)
    assert out["group_nothing"] == [1.0, 3.0]
    assert out["group_nothing_advantage"] == pytest.approx([-1.0, 0.75])


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
    loss = rwml.grpo_loss(logp, logp, None, ADV, w, beta=0.0)  # ratio 1: loss = -A per token
    assert loss.item() == pytest.approx(expect)
    stats = rwml.loss_stats(logp, logp, None, ADV, w)
    assert stats["clip_ratio"] == 0.0 and stats["kl"] == 0.0


def test_clipping_by_hand():
    one = torch.ones(1, 1)
    w = rwml.token_weights(one, "grpo", 1)
    up, down = torch.log(torch.tensor([[1.5]])), torch.log(torch.tensor([[0.5]]))
    zero = torch.zeros(1, 1)
    # A > 0, ratio 1.5: clipped to 1.2 -> -1.2 A ; with epsilon_high 0.28 -> -1.28 A
    assert rwml.grpo_loss(up, zero, None, torch.tensor([2.0]), w, beta=0.0).item() == pytest.approx(-2.4)
    assert (rwml.grpo_loss(up, zero, None, torch.tensor([2.0]), w, beta=0.0, epsilon_high=0.28).item()
            == pytest.approx(-2.56))
    # A < 0, ratio 1.5: the unclipped term is the smaller one -> -1.5 A
    assert rwml.grpo_loss(up, zero, None, torch.tensor([-2.0]), w, beta=0.0).item() == pytest.approx(3.0)
    # A < 0, ratio 0.5: clipped to 0.8 -> -0.8 A
    loss = rwml.grpo_loss(down, zero, None, torch.tensor([-2.0]), w, beta=0.0)
    assert (loss.item() == pytest.approx(1.6)
            and rwml.loss_stats(down, zero, None, torch.tensor([-2.0]), w)["clip_ratio"] == 1.0)


def test_k3_kl_by_hand():
    logp, ref = torch.zeros(1, 1), torch.log(torch.tensor([[2.0]]))
    w = rwml.token_weights(torch.ones(1, 1), "grpo", 1)
    loss = rwml.grpo_loss(logp, logp, ref, torch.tensor([0.0]), w, beta=0.5)
    stats = rwml.loss_stats(logp, logp, rwml.kl_k3(ref, logp), torch.tensor([0.0]), w)
    k3 = 2.0 - math.log(2.0) - 1
    assert stats["kl"] == pytest.approx(k3) and loss.item() == pytest.approx(0.5 * k3)


def test_completion_mask_from_first_eos():
    ids = torch.tensor([[5, 6, 9, 9, 9], [5, 6, 7, 8, 4], [9, 1, 9, 2, 3]])
    assert engine.completion_mask_from(ids, 9).tolist() == [[1, 1, 1, 0, 0], [1, 1, 1, 1, 1], [1, 0, 0, 0, 0]]


# ------------------------------------------------------------------ log-probs on a real (tiny) model

@pytest.fixture(scope="module")
def tiny(tiny_model):
    model, tok = engine.load_model(tiny_model)
    return engine.add_lora(model, r=4, alpha=8), tok


def rollout(model, tok, n=4, length=12):
    torch.manual_seed(0)
    return engine.sample_chat(model, tok, ["go to desk 1", "open the drawer 2 please"],
                              system=envs.Alfworld.wm_system, prefix=rwml.WM_PREFIX, stop=rwml.WM_STOP,
                              n=n // 2, max_new_tokens=length)


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
    ids, attn, cmask = roll.input_ids, roll.attention_mask, roll.completion_mask
    adv = torch.tensor([1.0, -1.0, 0.5, -0.5])
    grads = []
    for fn in (lambda: engine.completion_logprobs(model, ids, attn, cmask, chunk_size=5),
               lambda: naive_logprobs(model, ids, attn, cmask),
               lambda: rwml.logprobs(model, ids, attn, cmask)):  # the plain definition, rwml.logprobs
        model.zero_grad()
        lp = fn()
        w = rwml.token_weights(cmask, "grpo", 12)
        loss = rwml.grpo_loss(lp, lp.detach(), None, adv, w, beta=0.0)
        loss.backward()
        grads.append((lp.detach(), {n: p.grad.clone() for n, p in model.named_parameters()
                                    if p.requires_grad}))
    (lp_a, g_a), *others = grads
    for lp_b, g_b in others:
        assert torch.allclose(lp_a, lp_b, atol=1e-5)
        assert all(torch.allclose(g_a[n], g_b[n], atol=1e-6, rtol=1e-4) for n in g_a)
    assert (lp_a[cmask.bool()] < 0).all() and (lp_a[~cmask.bool()] == 0).all()
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
    roll = engine.sample_chat(model, tok, ["go to desk 1", "open the drawer 2 please", "look"],
                            system=envs.Alfworld.wm_system, prefix=rwml.WM_PREFIX, stop=rwml.WM_STOP, n=3,
                            max_new_tokens=10)
    ids, attn, cmask = roll.input_ids, roll.attention_mask, roll.completion_mask
    P = ids.shape[1] - cmask.shape[1]
    assert (attn[:, :P] == 0).any()  # prompts of different lengths: left padding is exercised
    adv = torch.linspace(-1, 1, ids.shape[0])
    w = rwml.token_weights(cmask, "grpo", 10)
    grads = []
    for fn in (lambda: engine.group_logprobs(model, ids[::3, :P], attn[::3, :P], ids[:, P:], cmask,
                                           chunk_size=7),
               lambda: naive_logprobs(model, ids, attn, cmask)):
        model.zero_grad()
        lp = fn()
        loss = rwml.grpo_loss(lp, lp.detach(), None, adv, w, beta=0.0)
        loss.backward()
        grads.append((lp.detach(), {n: p.grad.clone() for n, p in model.named_parameters()
                                    if p.requires_grad}))
    (lp_a, g_a), (lp_b, g_b) = grads
    assert torch.allclose(lp_a, lp_b, atol=1e-5)
    for n in g_a:
        assert torch.allclose(g_a[n], g_b[n], atol=1e-6, rtol=1e-4), n
    # k, v: through the cache
    assert all(g_a[n].abs().sum() > 0 for n in g_a if "lora_A" in n and "k_proj" in n)


def test_gradient_checkpointing_gives_the_same_logprobs_and_gradients(tiny_model):
    """--gradient-checkpointing: transformers drops the key/value cache in a checkpointed training forward,
    so group_logprobs takes whole rows there; log-probs and LoRA gradients equal the cached path's."""
    results = []
    for checkpointing in (False, True):
        model, tok = engine.load_model(tiny_model)
        torch.manual_seed(0)
        model = engine.add_lora(model, r=4, alpha=8, gradient_checkpointing=checkpointing)
        with torch.no_grad():
            for n, p in model.named_parameters():
                if "lora_B" in n:
                    p.normal_(0, 0.02)
        assert model.get_base_model().is_activation_checkpointing is checkpointing
        roll = rollout(model, tok)
        ids, attn, cmask = roll.input_ids, roll.attention_mask, roll.completion_mask
        P = ids.shape[1] - cmask.shape[1]
        model.train()
        lp = engine.group_logprobs(model, ids[::2, :P], attn[::2, :P], ids[:, P:], cmask, chunk_size=5)
        rwml.grpo_loss(lp, lp.detach(), None, torch.tensor([1.0, -1.0, 0.5, -0.5]),
                       rwml.token_weights(cmask, "grpo", 12), beta=0.0).backward()
        results.append((lp.detach(), {n: p.grad for n, p in model.named_parameters() if p.requires_grad}))
    (lp_a, g_a), (lp_b, g_b) = results
    assert torch.allclose(lp_a, lp_b, atol=1e-5)
    for n in g_a:
        assert torch.allclose(g_a[n], g_b[n], atol=1e-6, rtol=1e-4), n


def test_kl_is_zero_against_itself_and_positive_against_another_policy(tiny_model, lora_model, tmp_path):
    """The k3 KL of a policy against itself is exactly 0, and > 0 against a different one: with an adapter
    that is not the identity, the warm-up-style reference (a frozen copy, "ref") gives 0 and the bare base
    model gives > 0. A reference that silently pointed at the wrong weights fails one of the two."""

    model, tok = lora_model(seed=0, std=0.3)
    model.save_pretrained(tmp_path / "start")
    base, tok = engine.load_model(tiny_model)
    model = train.start_adapter(train.Settings(), base, tmp_path / "start")
    roll = rollout(model, tok)
    batch = rwml.Batch(input_ids=roll.input_ids, attention_mask=roll.attention_mask,
                       completion_mask=roll.completion_mask, advantages=torch.zeros(4),
                       weights=rwml.token_weights(roll.completion_mask, "grpo", 12))
    cfg = train.Settings(beta=0.1, micro_batch_size=4)
    opt = torch.optim.SGD([p for p in model.parameters() if p.requires_grad], lr=0.0)
    assert rwml.grpo_update(model, opt, batch, cfg)[0]["kl"] == 0.0  # reference = the frozen start adapter
    args = roll.input_ids, roll.attention_mask, roll.completion_mask
    with torch.no_grad():
        logp = engine.completion_logprobs(model, *args)
        with model.disable_adapter():
            bare = engine.completion_logprobs(model, *args)
    stats = rwml.loss_stats(logp, logp, rwml.kl_k3(bare, logp), torch.zeros(4), batch.weights)
    assert stats["kl"] > 1e-3  # the bare base model is another policy


# ------------------------------------------------------------------ the easy filter's keep rule

def test_easy_filter_marks_the_easiest_share_and_keeps_a_tenth():
    scores = [i / 1000 for i in range(1, 10001)]  # all distinct, all > 0
    keep, easy, tau = rwml.easy_subsample(scores, easy_share=0.3, keep_prob=0.1, seed=0)
    assert sum(easy) == 3000 and all(easy[i] == (scores[i] >= tau) for i in range(len(scores)))
    assert tau == pytest.approx(7.001)
    assert all(k for k, e in zip(keep, easy) if not e)  # every non-easy triplet is kept
    kept_easy = sum(k for k, e in zip(keep, easy) if e)
    assert 240 <= kept_easy <= 360  # ~ Binomial(3000, 0.1): mean 300, sd 16


def test_easy_filter_is_the_papers_threshold_rule_with_ties():
    """easy iff easiness >= tau_easy: with K samples easiness has K + 1 values, ties are the rule, and
    every triplet at the threshold is easy (a rank cut would call exactly 30 % easy, at random)."""
    scores = [1.0] * 50 + [0.5] * 30 + [0.0] * 20  # shares at or above: 1.0 -> 50 %, 0.5 -> 80 %, 0 -> 100 %
    keep, easy, tau = rwml.easy_subsample(scores, 0.3, 0.1, seed=1)
    assert tau == 1.0 and sum(easy) == 50 and all(e == (s >= 1.0) for s, e in zip(scores, easy))
    scores = [1.0] * 10 + [0.75] * 25 + [0.25] * 65  # 10 % at 1.0, 35 % at >= 0.75: 0.75 is closest to 30 %
    assert rwml.easy_threshold(scores, 0.3) == 0.75
    assert rwml.easy_threshold([0.5] * 100, 0.3) == 0.5  # all tied: all easy, not 30 picked at random
    assert rwml.easy_threshold([0.0] * 90 + [1.0] * 10, 0.3) == 1.0  # only the 10 with easiness > 0
    assert rwml.easy_threshold([0.0] * 100, 0.3) is None  # nobody is easy when every sample failed
    # equally close (50 %, 100 %): the smaller
    assert rwml.easy_threshold([0.25, 0.75, 0.75, 0.25], 0.75) == 0.25


def test_easy_filter_drops_most_of_a_dominant_easy_target():
    """Where 90 % of targets are "Nothing happens." and all of them are easy, the threshold rule calls
    them all easy and keeps ~10 % of them (the rank cut called 30 % easy and kept most)."""
    scores = [1.0] * 900 + [0.0] * 100
    keep, easy, tau = rwml.easy_subsample(scores, 0.3, 0.1, seed=0)
    assert sum(easy) == 900 and 60 <= sum(k for k, e in zip(keep, easy) if e) <= 120


def test_split_is_ninety_ten_and_disjoint():
    trips = [dict(i=i) for i in range(50)]
    train, held = rwml.split_triplets(trips, 0.1, seed=0)
    assert len(train) == 45 and len(held) == 5
    assert sorted(t["i"] for t in train + held) == list(range(50))


def test_shared_prefill_gives_the_same_tokens_as_plain_generate(tiny_model):
    model, tok = engine.load_model(tiny_model)
    texts = [engine.chat(tok, "go to desk 1"),
             engine.chat(tok, "a much longer prompt: open the drawer 2, then look")]
    plain = tok(texts, return_tensors="pt", padding=True, add_special_tokens=False)
    repeated = tok([t for t in texts for _ in range(3)], return_tensors="pt", padding=True,
                   add_special_tokens=False)
    ref = model.generate(**repeated, max_new_tokens=10, do_sample=False, pad_token_id=tok.pad_token_id)
    shared = engine.sample(model, tok, texts, n=3, max_new_tokens=10, temperature=0.0).input_ids
    assert torch.equal(shared, ref)
    torch.manual_seed(0)  # sampling: n different continuations per prompt, prompts kept in place
    out = engine.sample(model, tok, texts, n=3, max_new_tokens=10, temperature=1.0).input_ids
    assert out.shape[0] == 6 and torch.equal(out[:, :plain["input_ids"].shape[1]],
                                             plain["input_ids"].repeat_interleave(3, 0))
    assert len({tuple(r) for r in out[:3, -10:].tolist()}) > 1


def test_compact_decoding_equals_generate_as_rows_end_at_different_steps(tiny_model, monkeypatch):
    """engine.decode drops each row from the batch once it ends; generate runs every row to the longest. Made
    to end early (a frequent token counts as end-of-turn, and a stop string), the greedy tokens, the returned
    width and the completion masks are generate's; sampled rows end at their end token (or the cap)."""
    model, tok = engine.load_model(tiny_model)
    texts = [engine.chat(tok, p) for p in ("go to desk 1", "open the drawer 2, then look", "take the apple")]
    monkeypatch.setattr(engine, "DECODER", "generate")
    first = engine.sample(model, tok, texts, n=2, max_new_tokens=12, temperature=0.0)
    sampled = {}
    for decoder in ("generate", "compact"):  # while no row ends, both draw the same random numbers
        monkeypatch.setattr(engine, "DECODER", decoder)
        torch.manual_seed(1)
        sampled[decoder] = engine.sample(model, tok, texts, n=2, max_new_tokens=6, temperature=1.0, top_p=0.9)
    assert sampled["compact"].completion_mask.all()
    assert torch.equal(sampled["compact"].input_ids, sampled["generate"].input_ids)
    monkeypatch.setattr(engine, "DECODER", "generate")
    counts = torch.bincount(first.input_ids[:, -12:].flatten())
    end = int(counts.argmax())  # a token most rows write, at different steps
    monkeypatch.setattr(engine, "stop_token_ids", lambda model, tokenizer: [end])
    rolls = {}
    for decoder in ("generate", "compact"):
        monkeypatch.setattr(engine, "DECODER", decoder)
        rolls[decoder] = [engine.sample(model, tok, texts, n=2, max_new_tokens=12, temperature=0.0, stop=stop)
                          for stop in (None, tok.decode(first.completion_ids[0][2:4]))]
    for ours, ref in zip(rolls["compact"], rolls["generate"]):
        assert torch.equal(ours.input_ids, ref.input_ids)
        assert torch.equal(ours.completion_mask, ref.completion_mask)
        assert ours.texts == ref.texts
    lengths = rolls["compact"][0].completion_mask.sum(1)
    assert lengths.min() < lengths.max()  # rows did end at different steps
    monkeypatch.setattr(engine, "DECODER", "compact")
    torch.manual_seed(0)
    roll = engine.sample(model, tok, texts, n=4, max_new_tokens=12, temperature=1.0, top_p=0.9)
    for ids, m in zip(roll.input_ids[:, -roll.completion_mask.shape[1]:], roll.completion_mask):
        n = int(m.sum())
        assert n == m.shape[0] or int(ids[n - 1]) == end  # a row stops at its end token, or at the cap


# ------------------------------------------------------- clip ratio, micro-batches, sampling distribution

def test_clip_ratio_counts_only_tokens_where_the_clip_acts():
    """TRL's definition: a token counts when the clipped term wins the min, i.e. the ratio left the trust
    region in the direction the advantage pushes. Ratio 1.5 with A < 0 is outside [0.8, 1.2] but not
    clipped."""
    w = rwml.token_weights(torch.ones(1, 1), "grpo", 1)
    up, down, zero = torch.log(torch.tensor([[1.5]])), torch.log(torch.tensor([[0.5]])), torch.zeros(1, 1)
    assert rwml.loss_stats(up, zero, None, torch.tensor([-1.0]), w)["clip_ratio"] == 0.0
    assert rwml.loss_stats(up, zero, None, torch.tensor([1.0]), w)["clip_ratio"] == 1.0
    assert rwml.loss_stats(down, zero, None, torch.tensor([1.0]), w)["clip_ratio"] == 0.0
    assert rwml.loss_stats(down, zero, None, torch.tensor([-1.0]), w)["clip_ratio"] == 1.0


@pytest.mark.parametrize("loss_type", ["grpo", "dapo", "dr_grpo"])
def test_micro_batches_accumulate_to_the_big_batch_update(lora_model, loss_type):
    """Gradient accumulation over micro-batches gives the same update as one forward of the whole batch,
    for every loss_type (the weights are those of the whole batch, not of each micro-batch)."""
    deltas = []
    for micro in (6, 2, 1):
        model, tok = lora_model(seed=0, std=0.05)
        prompts = [tok(engine.chat(tok, p))["input_ids"]
                   for p in ("go to desk 1", "open the drawer 2 please", "look")]
        completions = [tok(c)["input_ids"]
                       for c in ("You arrive", "Nothing happens.", "You", "You open it", "ok", "x")]
        ids, attn, cmask = engine.pack([p for p in prompts for _ in range(2)], completions, tok.pad_token_id)
        assert len(set(cmask.sum(1).tolist())) > 1  # completions of different lengths: the weights matter
        batch = rwml.Batch(input_ids=ids, attention_mask=attn, completion_mask=cmask,
                           advantages=torch.tensor([1.0, -1.0, 0.5, -0.5, 2.0, -2.0]),
                           weights=rwml.token_weights(cmask, loss_type, 16))
        before = {n: p.detach().clone() for n, p in model.named_parameters() if p.requires_grad}
        opt = torch.optim.SGD([p for p in model.parameters() if p.requires_grad], lr=1.0)
        cfg = GRPOConfig(micro_batch_size=micro, beta=0.0, max_grad_norm=1e9, loss_type=loss_type)
        rwml.grpo_update(model, opt, batch, cfg)
        deltas.append({n: p.detach() - before[n] for n, p in model.named_parameters() if p.requires_grad})
    for other in deltas[1:]:
        for n in deltas[0]:
            assert torch.allclose(deltas[0][n], other[n], atol=1e-6, rtol=1e-4), n
    assert any(d.abs().sum() > 0 for d in deltas[0].values())


@pytest.fixture(scope="module")
def penalised_model(tmp_path_factory, tiny_model):
    """The tiny model with a generation_config that a real checkpoint could ship: repetition penalty and
    top-k."""
    import shutil

    from transformers import GenerationConfig

    folder = tmp_path_factory.mktemp("penalised")
    shutil.copytree(tiny_model, folder, dirs_exist_ok=True)
    GenerationConfig(repetition_penalty=5.0, top_k=3, do_sample=True, temperature=0.3).save_pretrained(folder)
    return str(folder)


def test_sampling_ignores_the_checkpoints_generation_config(penalised_model):
    """Greedy decoding picks the argmax of the plain logits at every step, whatever penalty or top-k the
    checkpoint's generation_config ships (transformers would apply them: samples off the trained policy)."""
    model, tok = engine.load_model(penalised_model)
    assert model.generation_config.repetition_penalty == 5.0
    roll = engine.sample(model, tok, [engine.chat(tok, "go to desk 1"), engine.chat(tok, "open the fridge")],
                       max_new_tokens=12, temperature=0.0)
    ids, attn, cmask = roll.input_ids, roll.attention_mask, roll.completion_mask
    pos = (attn.cumsum(-1) - 1).clamp(min=0)
    with torch.no_grad():
        logits = model(input_ids=ids, attention_mask=attn, position_ids=pos).logits
    C = cmask.shape[1]
    argmax = logits[:, -C - 1:-1].argmax(-1)
    assert torch.equal(argmax[cmask.bool()], ids[:, -C:][cmask.bool()])


@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_sampler_log_probs_equal_the_trained_log_probs(penalised_model, temperature):
    """The distribution the sampler draws from (its processed scores) is softmax(logits / T), exactly the
    one `completion_logprobs(temperature=T)` trains on, for T != 1 too."""
    model, tok = engine.load_model(penalised_model)
    batch = tok([engine.chat(tok, "go to desk 1")] * 2, return_tensors="pt", padding=True,
                add_special_tokens=False)
    torch.manual_seed(0)
    with engine.checkpoint_generation_config_off(model):
        out = model.generate(**batch,
                             generation_config=engine.sampling_config(model, tok, temperature=temperature,
                                                                    top_p=1.0, max_new_tokens=8),
                             output_scores=True, return_dict_in_generate=True)
    P = batch["input_ids"].shape[1]
    completion = out.sequences[:, P:]
    cmask = engine.completion_mask_from(completion, engine.stop_token_ids(model, tok), tok.pad_token_id)
    sampler = torch.stack(out.scores, 1).float().log_softmax(-1).gather(-1, completion[..., None]).squeeze(-1)
    attn = torch.cat([batch["attention_mask"], cmask], 1)
    with torch.no_grad():
        trained = engine.completion_logprobs(model, out.sequences, attn, cmask, temperature=temperature)
    assert torch.allclose(sampler[cmask.bool()], trained[cmask.bool()], atol=1e-4)


def test_a_stop_string_ends_the_mask_and_padding_is_never_trained(tiny_model):
    """Rows that stop on a string are padded by generate with the pad token, which is SmolLM2's (and this
    tiny model's) eos: the mask ends at the token that completed the stop string, so that pad is never read
    as a sampled eos. Checked on the raw tokens, without skip_special_tokens."""
    model, tok = engine.load_model(tiny_model)
    assert tok.pad_token_id == tok.eos_token_id
    torch.manual_seed(0)
    roll = engine.sample(model, tok, [engine.chat(tok, "go to desk 1")] * 8, max_new_tokens=40,
                         temperature=1.0, stop="e")
    stopped = [j for j, t in enumerate(roll.texts) if t.endswith("e")]
    assert stopped, "no row sampled an 'e' in 40 bytes"
    for j in stopped:
        raw = tok.decode(roll.completion_ids[j], skip_special_tokens=False)
        assert raw.endswith("e") and "e" not in raw[:-1] and tok.eos_token not in raw
        width = roll.completion_mask.shape[1]
        if len(roll.completion_ids[j]) < width:  # the row was padded after its stop
            assert roll.input_ids[j, -width + len(roll.completion_ids[j])] == tok.pad_token_id

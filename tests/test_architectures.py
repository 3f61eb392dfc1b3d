"""The method on the architecture families it is most likely to meet: tiny random models built in code
(bench/random_models.py: 2 layers, hidden 64, a byte-level tokenizer with the family's chat template and
special tokens). Llama (Llama 3's template), SmolLM2-shaped Llama with tied embeddings (ChatML), Qwen2
(q/k/v biases, Qwen2.5's template), Qwen3 (q/k norms, its thinking switch), Gemma 2 (final-logit and
attention soft-capping, sliding window, no system role) and Gemma 3 (text-only: sliding-window / global
layers, a hybrid cache). For each: load (also NF4), LoRA, shared-prefill sampling, chunked and shared-prompt
log-probs and their gradients against the naive full-logits path, a stage-1 and a stage-2 step, adapter
save and reload."""
import pytest
import torch
from bench.random_models import build

import engine
import envs
import rwml
import train
from stages.settings import GRPOConfig

ARCHS = {"llama": "tiny-llama3", "tied": "tiny-smollm2", "qwen2": "tiny-qwen2", "qwen3": "tiny-qwen3",
         "gemma2": "tiny-gemma2", "gemma3": "tiny-gemma3"}
PROMPTS = ["go to desk 1", "open the drawer 2, then look around the room", "look"]
TRIPLETS = [  # ALFWorld-shaped world-model triplets
    dict(task="put a clean mug in the coffeemachine", action="go to countertop 1",
         next_obs="You arrive at countertop 1. On the countertop 1, you see a mug 1.",
         history=[{"observation": "You are in the middle of a room."}]),
    dict(task="put a clean mug in the coffeemachine", action="take mug 1 from countertop 1",
         next_obs="You pick up the mug 1 from the countertop 1.",
         history=[{"observation": "You arrive at countertop 1. On the countertop 1, you see a mug 1."}]),
]


@pytest.fixture(scope="module", params=list(ARCHS))
def arch(request, tmp_path_factory):
    """(name, folder of the saved random model)."""
    return request.param, str(build(tmp_path_factory.mktemp(request.param), ARCHS[request.param]))


def load(folder, four_bit=False, targets="all-linear", scale=0.05):
    """The model with a LoRA adapter whose B matrices are not zero, so that gradients reach every matrix."""
    model, tok = engine.load_model(folder, device="cpu", load_in_4bit=four_bit)
    torch.manual_seed(0)
    model = engine.add_lora(model, r=4, alpha=8, target_modules=targets)
    with torch.no_grad():
        for n, p in model.named_parameters():
            if "lora_B" in n:
                p.normal_(0, scale)
    return model, tok


def naive_logprobs(model, ids, attn, cmask):
    """The reference: the model's own full logits (with whatever the architecture does to them), then
    log_softmax."""
    pos = (attn.cumsum(-1) - 1).clamp(min=0)
    logits = model(input_ids=ids, attention_mask=attn, position_ids=pos).logits
    C = cmask.shape[1]
    return logits[:, -C - 1:-1].float().log_softmax(-1).gather(-1, ids[:, -C:, None]).squeeze(-1) * cmask


FEATURES = {  # what makes each architecture itself, checked on the loaded model
    "llama": lambda m, c: not c.tie_word_embeddings,
    "tied": lambda m, c: m.get_output_embeddings().weight is m.get_input_embeddings().weight,
    "qwen2": lambda m, c: m.model.layers[0].self_attn.k_proj.bias.abs().sum() > 0,
    "qwen3": lambda m, c: hasattr(m.model.layers[0].self_attn, "q_norm"),
    "gemma2": lambda m, c: c.final_logit_softcapping and c.attn_logit_softcapping and c.sliding_window == 16,
    "gemma3": lambda m, c: (c.layer_types == ["sliding_attention", "full_attention"]
                            and c.sliding_window == 16),
}


def parity_reward(completions, targets=None):
    return [float(sum(map(ord, c)) % 2) for c in completions]


@pytest.mark.parametrize("four_bit", [False, True], ids=["fp32", "nf4"])
def test_load_and_lora_targets(arch, four_bit):
    from peft.tuners.lora import LoraLayer

    name, folder = arch
    if four_bit:
        pytest.importorskip("bitsandbytes")
    else:
        model, _ = engine.load_model(folder, device="cpu")
        assert FEATURES[name](model, model.config)
    for targets, expect in (("q_proj,k_proj,v_proj,o_proj", {"q_proj", "k_proj", "v_proj", "o_proj"}),
                            ("all-linear", {"q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj",
                                            "down_proj"})):
        model, tok = load(folder, four_bit, targets)
        got = {n.split(".")[-1] for n, m in model.named_modules() if isinstance(m, LoraLayer)}
        assert got == expect, (targets, got)
        assert all("lora_" in n for n, p in model.named_parameters() if p.requires_grad)
        if four_bit:
            assert any(type(m).__name__ == "Linear4bit" for m in model.modules())
    assert tok.pad_token_id is not None and engine.stop_token_ids(model, tok)


@pytest.mark.parametrize("temperature", [0.0, 1.0], ids=["greedy", "sampled"])
def test_shared_prefill_sampling_equals_plain_generate(arch, temperature, monkeypatch):
    """The n completions of a prompt that share one prefill (its key/value cache repeated n times) are token
    for token those of plain generate on n copies, greedy and sampled with one seed (prompts of different
    lengths, longer than Gemma's 16-token window). Through generate's loop: ours (engine.decode) draws
    fewer random numbers once a row ends (tests/test_grpo.py compares the two)."""
    monkeypatch.setattr(engine, "DECODER", "generate")
    name, folder = arch
    model, tok = engine.load_model(folder, device="cpu")
    texts = [engine.chat(tok, p, envs.Alfworld.wm_system, rwml.WM_PREFIX) for p in PROMPTS[:2]]
    torch.manual_seed(0)
    shared = engine.sample(model, tok, texts, n=3, max_new_tokens=10, temperature=temperature).input_ids
    batch = tok([t for t in texts for _ in range(3)], return_tensors="pt", padding=True,
                add_special_tokens=False)
    assert batch["attention_mask"].sum(1).min() > 16 and (batch["attention_mask"] == 0).any()
    cfg = engine.sampling_config(model, tok, temperature=temperature, top_p=1.0, max_new_tokens=10)
    torch.manual_seed(0)
    with engine.checkpoint_generation_config_off(model):
        plain = model.generate(**batch, generation_config=cfg)
    assert torch.equal(shared, plain)
    if temperature:
        P = batch["input_ids"].shape[1]
        assert len({tuple(r) for r in plain[:, P:].tolist()}) > 1


def test_compact_decoding_is_generates_on_every_architecture(arch, monkeypatch):
    """engine.decode (each row leaves the batch as it ends, its cache rows dropped, sliding-window layers
    included) writes generate's greedy tokens; made to end early, rows end at different steps."""
    name, folder = arch
    model, tok = engine.load_model(folder, device="cpu")
    texts = [engine.chat(tok, p, envs.Alfworld.wm_system, rwml.WM_PREFIX) for p in PROMPTS[:2]]
    monkeypatch.setattr(engine, "DECODER", "generate")
    first = engine.sample(model, tok, texts, n=2, max_new_tokens=10, temperature=0.0)
    end = int(torch.bincount(first.input_ids[:, -10:].flatten()).argmax())  # a token rows write
    monkeypatch.setattr(engine, "stop_token_ids", lambda model, tokenizer: [end])
    rolls = []
    for decoder in ("generate", "compact"):
        monkeypatch.setattr(engine, "DECODER", decoder)
        rolls.append(engine.sample(model, tok, texts, n=2, max_new_tokens=10, temperature=0.0))
    assert torch.equal(rolls[0].input_ids, rolls[1].input_ids)
    assert torch.equal(rolls[0].completion_mask, rolls[1].completion_mask)


@pytest.mark.parametrize("four_bit", [False, True], ids=["fp32", "nf4"])
def test_chunked_and_shared_prompt_logprobs_and_gradients_equal_the_naive_path(arch, four_bit):
    name, folder = arch
    if four_bit:
        pytest.importorskip("bitsandbytes")
    model, tok = load(folder, four_bit)
    torch.manual_seed(1)
    roll = engine.sample_chat(model, tok, PROMPTS, system=envs.Alfworld.wm_system, prefix=rwml.WM_PREFIX,
                            stop=rwml.WM_STOP, n=3, max_new_tokens=10)
    ids, attn, cmask = roll.input_ids, roll.attention_mask, roll.completion_mask
    P = ids.shape[1] - cmask.shape[1]
    adv, w = torch.linspace(-1, 1, ids.shape[0]), rwml.token_weights(cmask, "grpo", 10)
    paths = dict(naive=lambda: naive_logprobs(model, ids, attn, cmask),
                 chunked=lambda: engine.completion_logprobs(model, ids, attn, cmask, chunk_size=5),
                 shared=lambda: engine.group_logprobs(model, ids[::3, :P], attn[::3, :P], ids[:, P:], cmask,
                                                    chunk_size=7))
    got = {}
    for path, fn in paths.items():
        model.zero_grad()
        lp = fn()
        rwml.grpo_loss(lp, lp.detach(), None, adv, w, beta=0.0).backward()
        got[path] = lp.detach(), {n: p.grad.clone() for n, p in model.named_parameters() if p.requires_grad}
    lp, grads = got.pop("naive")
    assert (lp[cmask.bool()] < 0).all() and all(g.abs().sum() > 0 for n, g in grads.items() if "lora_A" in n)
    for path, (lp_b, grads_b) in got.items():
        assert torch.allclose(lp_b, lp, atol=1e-5), (path, (lp_b - lp).abs().max())
        for n in grads:
            assert torch.allclose(grads_b[n], grads[n], atol=1e-6, rtol=1e-4), (path, n)


class OneTurnGame:
    """A stand-in for ALFWorld with play's interface: one turn per episode, won in even slots (each group of
    episodes is then mixed, whatever a random model writes)."""
    system, stop, can_explore = envs.Alfworld.system, envs.Alfworld.stop, False
    counters, turn_fields = ("invalid",), {}

    def bind_model(self, model, tokenizer, **sampling):
        pass

    def reset(self, episodes):
        return {s: dict(obs="You are in the middle of a room.", game=str(ep["game"]),
                        task="put a mug in the sink", task_type="pick") for s, ep in episodes.items()}

    def prompt(self, slot, recent):
        return ("Your task is to: put a mug in the sink\n"
                "[Current observation] You are in the middle of a room.")

    def step(self, replies):
        return {s: dict(action=envs.parse_action(r)[0], obs="Nothing happens.", valid=True, format_ok=True,
                        won=s % 2 == 0, done=True, counts=dict(invalid=False)) for s, r in replies.items()}

    def finish(self, slot):
        return {}


def test_stage1_and_stage2_steps_then_the_saved_adapter_reloads(arch, tmp_path):
    """One GRPO step on world-model prompts (reasoning: the reply starts at <think>; shared prompt forward;
    KL against the bare base model), one stage-2 step on a game, then the adapter saved the peft way and
    loaded with PeftModel.from_pretrained gives the same log-probs."""
    from peft import PeftModel

    name, folder = arch
    model, tok = load(folder)
    cfg = GRPOConfig(num_generations=3, max_completion_length=8, micro_batch_size=6, beta=0.1)
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-2)
    before = {n: p.detach().clone() for n, p in model.named_parameters() if p.requires_grad}
    torch.manual_seed(2)
    res = rwml.grpo_step(model, tok, opt, TRIPLETS, parity_reward, cfg, reasoning=True)
    assert not res["updates"][0]["skipped"] and res["sample"].startswith(rwml.WM_PREFIX)
    assert any(not torch.equal(p, before[n]) for n, p in model.named_parameters() if p.requires_grad)
    res = rwml.policy_step(model, tok, opt, OneTurnGame(), ["g1", "g2"], GRPOConfig(
        num_generations=2, max_completion_length=8, beta=0.1), num_envs=4)
    assert res["num_turns"] == 4 and res["trained_turns"] == 4 and not res["updates"][0]["skipped"]

    roll = engine.sample_chat(model, tok, PROMPTS, prefix=envs.AGENT_PREFIX, max_new_tokens=8,
                              temperature=0.0)
    args = roll.input_ids, roll.attention_mask, roll.completion_mask
    with torch.no_grad():
        want = engine.completion_logprobs(model, *args)
    saved = train.save_adapter(model, tmp_path)
    reloaded = PeftModel.from_pretrained(engine.load_model(folder, device="cpu")[0], str(saved))
    with torch.no_grad():
        assert torch.allclose(engine.completion_logprobs(reloaded, *args), want, atol=1e-6)
        assert torch.allclose(naive_logprobs(reloaded, *args), want, atol=1e-5)


def test_every_architecture_takes_both_fast_paths(arch, capsys):
    """Gemma 2's soft-capping is reproduced by our projection and Gemma 3's sliding-window cache repeats:
    no architecture here needs the plain path (the checks above then tested the fast paths themselves)."""
    name, folder = arch
    model, _ = load(folder)
    assert engine.fast_paths(model) == engine.FastPaths(head=True, shared_prompt=True)
    assert "rwml:" not in capsys.readouterr().out


@pytest.fixture(scope="module")
def gemma2(tmp_path_factory):
    return str(build(tmp_path_factory.mktemp("gemma2"), "tiny-gemma2"))


def test_a_projection_that_misses_the_architectures_logits_falls_back_to_the_plain_path(gemma2, monkeypatch,
                                                                                       capsys):
    """Our projection without Gemma 2's soft-capping (as before it knew of it): the once-per-model check
    sees other numbers, says so once, and log-probs and gradients come from the model's own logits."""
    def uncapped(hidden, weight, bias, targets, temperature, softcap):
        logits = torch.nn.functional.linear(hidden, weight, bias).float() / temperature
        return logits.gather(-1, targets.unsqueeze(-1)).squeeze(-1) - logits.logsumexp(-1)

    monkeypatch.setattr(engine, "_chunk_logps", uncapped)
    monkeypatch.setattr(engine, "_SAID", set())
    model, tok = load(gemma2)
    torch.manual_seed(1)
    roll = engine.sample_chat(model, tok, PROMPTS, system=envs.Alfworld.wm_system, prefix=rwml.WM_PREFIX, n=3,
                            max_new_tokens=8)
    ids, attn, cmask = roll.input_ids, roll.attention_mask, roll.completion_mask
    P = ids.shape[1] - cmask.shape[1]
    assert engine.fast_paths(model) == engine.FastPaths(head=False, shared_prompt=True)
    with torch.no_grad():
        bug = (engine._decoder_logprobs(model, ids, attn, cmask, 1.0, 512)
               - naive_logprobs(model, ids, attn, cmask))
    assert bug.abs().max() > 0.1
    got = []
    for fn in (lambda: naive_logprobs(model, ids, attn, cmask),
               lambda: engine.completion_logprobs(model, ids, attn, cmask),
               lambda: engine.group_logprobs(model, ids[::3, :P], attn[::3, :P], ids[:, P:], cmask)):
        model.zero_grad()
        lp = fn()
        lp.sum().backward()
        got.append((lp.detach(), {n: p.grad.clone() for n, p in model.named_parameters() if p.requires_grad}))
    (want, want_grads), *others = got
    for lp, grads in others:
        assert torch.allclose(lp, want, atol=1e-5)
        assert all(torch.allclose(grads[n], want_grads[n], atol=1e-6, rtol=1e-4) for n in grads)
    # another copy of the model: checked, not said again
    assert engine.fast_paths(load(gemma2)[0]).head is False
    out = capsys.readouterr().out
    assert out.count("rwml: Gemma2ForCausalLM: log-probs from its own full logits") == 1, out


def test_a_cache_that_does_not_repeat_falls_back_to_whole_rows(gemma2, monkeypatch, capsys):
    """A cache whose batch_repeat_interleave fails (as a recurrent-state cache may): sampling prefills every
    copy and a group's log-probs run on whole rows; the numbers are those of the plain path."""
    from transformers import DynamicCache

    def unsupported(self, repeats):
        raise NotImplementedError("no repeat here")

    monkeypatch.setattr(DynamicCache, "batch_repeat_interleave", unsupported)
    monkeypatch.setattr(engine, "_SAID", set())
    model, tok = load(gemma2)
    assert engine.fast_paths(model) == engine.FastPaths(head=True, shared_prompt=False)
    assert "no shared prompt cache" in capsys.readouterr().out
    texts = [engine.chat(tok, p, envs.Alfworld.wm_system, rwml.WM_PREFIX) for p in PROMPTS[:2]]
    roll = engine.sample(model, tok, texts, n=3, max_new_tokens=8, temperature=0.0)
    ids, attn, cmask = roll.input_ids, roll.attention_mask, roll.completion_mask
    P = ids.shape[1] - cmask.shape[1]
    lp = engine.group_logprobs(model, ids[::3, :P], attn[::3, :P], ids[:, P:], cmask)
    assert torch.allclose(lp, naive_logprobs(model, ids, attn, cmask), atol=1e-5)


# ------------------------------------------------------------------ chat templates and our own markup

QWEN3_FORCED = ("{% for m in messages %}"
                "{{ '<|im_start|>' + m['role'] + '\\n' + m['content'] + '<|im_end|>\\n' }}{% endfor %}"
                "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n<think>\\n' }}{% endif %}")


def test_our_thinking_prefix_and_the_templates_thinking_markup_do_not_collide(tmp_path):
    """Qwen3's template: with our <think> prefix (reasoning world model, agent) its thinking stays on and the
    reply starts at our <think>, once; without it (direct <next_state>, the tau2 customer) its own empty
    block comes first, as in Qwen3's non-thinking mode. A template that always opens <think> (Qwen3's
    thinking-only releases) gives the same two prompts. <think> is one token, as in Qwen3's tokenizer."""
    tok = engine.load_model(str(build(tmp_path / "qwen3", "tiny-qwen3")), device="cpu")[1]
    head = "<|im_start|>system\nS<|im_end|>\n<|im_start|>user\nP<|im_end|>\n<|im_start|>assistant\n"
    for template in (tok.chat_template, QWEN3_FORCED):
        tok.chat_template = template
        assert engine.chat(tok, "P", "S", rwml.WM_PREFIX) == head + "<think>"
        assert engine.chat(tok, "P", "S", envs.AGENT_PREFIX) == head + "<think>"
        assert engine.chat(tok, "P", "S", "<next_state>") == head + "<think>\n\n</think>\n\n<next_state>"
        msgs = [{"role": "system", "content": "S"}, {"role": "user", "content": "P"}]
        assert engine.chat_template(tok, msgs) == head + "<think>\n\n</think>\n\n"
    think, turn = tok.convert_tokens_to_ids(["<think>", "<|im_start|>"])
    ids = tok(engine.chat(tok, rwml.wm_prompt(TRIPLETS[0], True), envs.Alfworld.wm_system, rwml.WM_PREFIX),
              add_special_tokens=False)["input_ids"]
    reply = ids[len(ids) - ids[::-1].index(turn):]  # the assistant's turn (the prompt shows <think> too)
    assert reply[-1] == think and reply.count(think) == 1


def test_a_template_without_a_system_role_gets_it_in_the_first_user_turn(tmp_path):
    tok = engine.load_model(str(build(tmp_path / "gemma2", "tiny-gemma2")), device="cpu")[1]
    assert engine.chat(tok, "P", "S", "<next_state>") == ("<bos><start_of_turn>user\nS\n\nP<end_of_turn>\n"
                                                         "<start_of_turn>model\n<next_state>")
    assert engine.chat(tok, "P") == "<bos><start_of_turn>user\nP<end_of_turn>\n<start_of_turn>model\n"
    chat = [{"role": "system", "content": "S"}, {"role": "user", "content": "hi"},
            {"role": "assistant", "content": "ok"}, {"role": "user", "content": "P"}]
    assert engine.chat_template(tok, chat).startswith("<bos><start_of_turn>user\nS\n\nhi<end_of_turn>\n"
                                                    "<start_of_turn>model\nok<end_of_turn>")

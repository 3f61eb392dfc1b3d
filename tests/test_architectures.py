"""Chat templates of the families the method may meet, around our own markup (the <think> / <next_state>
the replies start with): tiny tokenizers with each family's template (bench/random_models.py)."""
import envs
import rwml
from bench.random_models import build

TRIPLETS = [dict(task="put a clean mug in the coffeemachine", action="go to countertop 1",
                 next_obs="You arrive at countertop 1.", history=[{"observation": "You are in the middle of a room."}])]


QWEN3_FORCED = ("{% for m in messages %}{{ '<|im_start|>' + m['role'] + '\\n' + m['content'] + '<|im_end|>\\n' }}"
                "{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n<think>\\n' }}{% endif %}")


def test_our_thinking_prefix_and_the_templates_thinking_markup_do_not_collide(tmp_path):
    """Qwen3's template: with our <think> prefix (reasoning world model, agent) its thinking stays on and the
    reply starts at our <think>, once; without it (direct <next_state>, the tau2 customer) its own empty
    block comes first, as in Qwen3's non-thinking mode. A template that always opens <think> (Qwen3's
    thinking-only releases) gives the same two prompts. <think> is one token, as in Qwen3's tokenizer."""
    tok = rwml.load_model(str(build(tmp_path / "qwen3", "tiny-qwen3")), device="cpu")[1]
    head = "<|im_start|>system\nS<|im_end|>\n<|im_start|>user\nP<|im_end|>\n<|im_start|>assistant\n"
    for template in (tok.chat_template, QWEN3_FORCED):
        tok.chat_template = template
        assert rwml.chat(tok, "P", "S", rwml.WM_PREFIX) == head + "<think>"
        assert rwml.chat(tok, "P", "S", envs.AGENT_PREFIX) == head + "<think>"
        assert rwml.chat(tok, "P", "S", "<next_state>") == head + "<think>\n\n</think>\n\n<next_state>"
        msgs = [{"role": "system", "content": "S"}, {"role": "user", "content": "P"}]
        assert rwml.chat_template(tok, msgs) == head + "<think>\n\n</think>\n\n"
    think, turn = tok.convert_tokens_to_ids(["<think>", "<|im_start|>"])
    ids = tok(rwml.chat(tok, rwml.wm_prompt(TRIPLETS[0]), rwml.WM_SYSTEM, rwml.WM_PREFIX),
              add_special_tokens=False)["input_ids"]
    reply = ids[len(ids) - ids[::-1].index(turn):]  # the assistant's turn (the prompt shows <think> too)
    assert reply[-1] == think and reply.count(think) == 1


def test_a_template_without_a_system_role_gets_it_in_the_first_user_turn(tmp_path):
    tok = rwml.load_model(str(build(tmp_path / "gemma2", "tiny-gemma2")), device="cpu")[1]
    assert rwml.chat(tok, "P", "S", "<next_state>") == ("<bos><start_of_turn>user\nS\n\nP<end_of_turn>\n"
                                                         "<start_of_turn>model\n<next_state>")
    assert rwml.chat(tok, "P") == "<bos><start_of_turn>user\nP<end_of_turn>\n<start_of_turn>model\n"
    chat = [{"role": "system", "content": "S"}, {"role": "user", "content": "hi"},
            {"role": "assistant", "content": "ok"}, {"role": "user", "content": "P"}]
    assert rwml.chat_template(tok, chat).startswith("<bos><start_of_turn>user\nS\n\nhi<end_of_turn>\n"
                                                    "<start_of_turn>model\nok<end_of_turn>")

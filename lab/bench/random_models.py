"""Random causal LMs built from a config, saved like a Hub checkpoint (no download), for tests and offline
checks, with a byte-level tokenizer and the chat template and special tokens of the model family's shape."""
from __future__ import annotations

from pathlib import Path

CHATML = ("{% for m in messages %}{{ '<|im_start|>' + m['role'] + '\n' + m['content'] + '<|im_end|>\n' }}"
          "{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}")

LLAMA3 = ("{{ bos_token }}{% for m in messages %}{% if loop.first and m['role'] != 'system' %}"
          "{{ '<|start_header_id|>system<|end_header_id|>\\n\\nCutting Knowledge Date: December 2023"
          "<|eot_id|>' }}"
          "{% endif %}{{ '<|start_header_id|>' + m['role'] + '<|end_header_id|>\\n\\n' + m['content'] "
          "| trim + '<|eot_id|>' }}{% endfor %}{% if add_generation_prompt %}"
          "{{ '<|start_header_id|>assistant<|end_header_id|>\\n\\n' }}{% endif %}")
QWEN25 = ("{% if messages[0]['role'] != 'system' %}{{ '<|im_start|>system\\nYou are Qwen, "
          "created by Alibaba Cloud. You are a helpful assistant.<|im_end|>\\n' }}{% endif %}" + CHATML)
# Qwen3's: earlier replies lose their thinking, and enable_thinking=false makes the generation prompt close an
# empty <think></think> block itself (the real template's lines, shortened)
QWEN3 = ("{% for m in messages %}{% set content = m['content'] %}{% if m['role'] == 'assistant' and "
         "'</think>' in content %}{% set content = content.split('</think>')[-1].lstrip('\\n') %}{% endif %}"
         "{{ '<|im_start|>' + m['role'] + '\\n' + content + '<|im_end|>\\n' }}{% endfor %}"
         "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% if enable_thinking is defined and "
         "enable_thinking is false %}{{ '<think>\\n\\n</think>\\n\\n' }}{% endif %}{% endif %}")
GEMMA2 = ("{{ bos_token }}{% if messages[0]['role'] == 'system' %}"
          "{{ raise_exception('System role not supported') }}{% endif %}{% for m in messages %}"
          "{% set role = 'model' if m['role'] == 'assistant' else m['role'] %}"
          "{{ '<start_of_turn>' + role + '\\n' + m['content'] | trim + '<end_of_turn>\\n' }}{% endfor %}"
          "{% if add_generation_prompt %}{{ '<start_of_turn>model\\n' }}{% endif %}")
GEMMA3 = ("{{ bos_token }}{% if messages[0]['role'] == 'system' %}"
          "{% set first = messages[0]['content'] + '\\n\\n' %}{% set loop_messages = messages[1:] %}"
          "{% else %}{% set first = '' %}{% set loop_messages = messages %}{% endif %}"
          "{% for m in loop_messages %}{% set role = 'model' if m['role'] == 'assistant' else m['role'] %}"
          "{{ '<start_of_turn>' + role + '\\n' + (first if loop.first else '') + m['content'] | trim + "
          "'<end_of_turn>\\n' }}{% endfor %}"
          "{% if add_generation_prompt %}{{ '<start_of_turn>model\\n' }}{% endif %}")

# family -> template, eos, pad (None: load_model pads with eos), bos, other control tokens, plain added tokens
# (Qwen3's <think>: decoding keeps it), every end-of-turn token the checkpoint's generation_config lists
FAMILIES = {
    "chatml": dict(template=CHATML, eos="<|im_end|>", pad="<|im_end|>", specials=["<|im_start|>"]),
    "llama3": dict(template=LLAMA3, eos="<|eot_id|>", pad=None, bos="<|begin_of_text|>",
                   specials=["<|start_header_id|>", "<|end_header_id|>", "<|end_of_text|>"],
                   stops=["<|end_of_text|>", "<|eot_id|>"]),
    "qwen2.5": dict(template=QWEN25, eos="<|im_end|>", pad="<|endoftext|>", specials=["<|im_start|>"],
                    stops=["<|im_end|>", "<|endoftext|>"]),
    "qwen3": dict(template=QWEN3, eos="<|im_end|>", pad="<|endoftext|>", specials=["<|im_start|>"],
                  plain=["<think>", "</think>"], stops=["<|im_end|>", "<|endoftext|>"]),
    "gemma2": dict(template=GEMMA2, eos="<eos>", pad="<pad>", bos="<bos>", specials=["<start_of_turn>",
                   "<end_of_turn>"], stops=["<eos>", "<end_of_turn>"]),
    "gemma3": dict(template=GEMMA3, eos="<eos>", pad="<pad>", bos="<bos>", specials=["<start_of_turn>",
                   "<end_of_turn>"], stops=["<eos>", "<end_of_turn>"]),
}

TINY = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, max_position_embeddings=32768)  # a tau2 prompt (~10 KB) is ~10k bytes
ARCH = dict(TINY, initializer_range=0.1)  # weights large enough that a completion depends on its prompt
# name -> (config class, its arguments, chat family); qwen2.5-*: the real shapes. Gemma's soft-caps (real
# 30 / 50) and sliding window are small so that a tiny model's logits and prompts reach them.
SHAPES = {
    "tiny-llama": ("LlamaConfig", TINY, "chatml"),
    "tiny-llama3": ("LlamaConfig", dict(ARCH, rope_theta=5e5), "llama3"),
    "tiny-smollm2": ("LlamaConfig", dict(ARCH, tie_word_embeddings=True), "chatml"),  # tied, as SmolLM2's
    # SmolLM2's vocabulary on the tiny body: vocabulary-sized logits dominate memory, as on the real model
    "tiny-wide": ("LlamaConfig", dict(TINY, vocab_size=49152, tie_word_embeddings=True), "chatml"),
    "tiny-qwen2": ("Qwen2Config", dict(ARCH, tie_word_embeddings=True), "qwen2.5"),  # q/k/v biases
    "tiny-qwen3": ("Qwen3Config", dict(ARCH, head_dim=16), "qwen3"),  # q/k norms
    "tiny-gemma2": ("Gemma2Config", dict(ARCH, head_dim=16, query_pre_attn_scalar=16, sliding_window=16,
                                         final_logit_softcapping=2.0, attn_logit_softcapping=2.0), "gemma2"),
    "tiny-gemma3": ("Gemma3TextConfig", dict(ARCH, head_dim=16, query_pre_attn_scalar=16, sliding_window=16,
                                             layer_types=["sliding_attention", "full_attention"]), "gemma3"),
    "qwen2.5-0.5b": ("Qwen2Config", dict(hidden_size=896, intermediate_size=4864, num_hidden_layers=24,
                                         num_attention_heads=14, num_key_value_heads=2, vocab_size=151936,
                                         tie_word_embeddings=True, rope_theta=1e6,
                                         max_position_embeddings=32768),
                     "qwen2.5"),
    "qwen2.5-1.5b": ("Qwen2Config", dict(hidden_size=1536, intermediate_size=8960, num_hidden_layers=28,
                                         num_attention_heads=12, num_key_value_heads=2, vocab_size=151936,
                                         tie_word_embeddings=True, rope_theta=1e6,
                                         max_position_embeddings=32768),
                     "qwen2.5"),
}


def byte_tokenizer(vocab_size: int | None = None, family: str = "chatml"):
    """Byte-level BPE without merges with `family`'s chat template and special tokens; `vocab_size` pads the
    vocabulary with plain tokens, so that a random model of a real vocabulary size decodes all it samples."""
    from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    f = FAMILIES[family]
    named = dict(eos_token=f["eos"], pad_token=f["pad"], bos_token=f.get("bos"))
    specials = [t for t in dict.fromkeys([*named.values(), *f["specials"]]) if t]
    vocab = {ch: i for i, ch in enumerate(sorted(pre_tokenizers.ByteLevel.alphabet()))}
    added = len(specials) + len(f.get("plain", []))
    for i in range(len(vocab), (vocab_size or 0) - added):  # the added tokens follow
        vocab[f"<t{i}>"] = i
    core = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    core.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    core.decoder = decoders.ByteLevel()
    tok = PreTrainedTokenizerFast(tokenizer_object=core, **{k: v for k, v in named.items() if v},
                                  additional_special_tokens=[t for t in specials if t not in named.values()])
    tok.add_tokens([AddedToken(t, special=False, normalized=False) for t in f.get("plain", [])])
    tok.chat_template = f["template"]
    return tok


def build(folder: Path, shape: str = "tiny-llama", dtype=None, seed: int = 0, **overrides) -> Path:
    """A random model of `shape` (config fields changed by `overrides`) and its tokenizer, saved in `folder`.
    Biases are drawn like the weights (the initialiser zeroes them), so that Qwen2's q/k/v biases count."""
    import torch
    import transformers

    config_cls, kwargs, family = SHAPES[shape]
    tok = byte_tokenizer(kwargs.get("vocab_size"), family)
    kwargs = dict(kwargs, vocab_size=kwargs.get("vocab_size", len(tok)), **overrides)
    config = getattr(transformers, config_cls)(**kwargs, eos_token_id=tok.eos_token_id,
                                               pad_token_id=tok.pad_token_id, bos_token_id=tok.bos_token_id)
    torch.manual_seed(seed)
    model = transformers.AutoModelForCausalLM.from_config(config)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith(".bias"):
                p.normal_(0, config.initializer_range)
    stops = FAMILIES[family].get("stops")
    if stops:
        model.generation_config.eos_token_id = tok.convert_tokens_to_ids(stops)
    if dtype is not None:
        model = model.to(dtype)
    model.save_pretrained(folder)
    tok.save_pretrained(folder)
    return Path(folder)

"""Random causal LMs built from a config, saved like a Hub checkpoint: for tests and for checks on machines
without network (no download). A byte-level tokenizer built in code, padded to the model's vocabulary so
that every sampled id decodes, with a ChatML chat template."""
from __future__ import annotations

from pathlib import Path

CHATML = ("{% for m in messages %}{{ '<|im_start|>' + m['role'] + '\n' + m['content'] + '<|im_end|>\n' }}"
          "{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}")

# name -> (transformers config class, its arguments); the Qwen2.5 shapes are those of the real checkpoints
SHAPES = {
    "tiny-llama": ("LlamaConfig", dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                                       num_key_value_heads=2, max_position_embeddings=8192)),
    "qwen2.5-0.5b": ("Qwen2Config", dict(hidden_size=896, intermediate_size=4864, num_hidden_layers=24,
                                         num_attention_heads=14, num_key_value_heads=2, vocab_size=151936,
                                         tie_word_embeddings=True, rope_theta=1e6, max_position_embeddings=32768)),
    "qwen2.5-1.5b": ("Qwen2Config", dict(hidden_size=1536, intermediate_size=8960, num_hidden_layers=28,
                                         num_attention_heads=12, num_key_value_heads=2, vocab_size=151936,
                                         tie_word_embeddings=True, rope_theta=1e6, max_position_embeddings=32768)),
}


def byte_tokenizer(vocab_size: int | None = None):
    """Byte-level BPE without merges (one token per byte), eos = pad = <|im_end|>; `vocab_size` pads the
    vocabulary with plain tokens, so that a random model of a real vocabulary size decodes whatever it samples."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {ch: i for i, ch in enumerate(sorted(pre_tokenizers.ByteLevel.alphabet()))}
    for i in range(len(vocab), (vocab_size or 0) - 2):  # 2 special tokens follow
        vocab[f"<t{i}>"] = i
    core = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    core.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    core.decoder = decoders.ByteLevel()
    tok = PreTrainedTokenizerFast(tokenizer_object=core, eos_token="<|im_end|>", pad_token="<|im_end|>",
                                  additional_special_tokens=["<|im_start|>"])
    tok.chat_template = CHATML
    return tok


def build(folder: Path, shape: str = "tiny-llama", dtype=None, seed: int = 0, **overrides) -> Path:
    """A random model of `shape` (config fields changed by `overrides`) and its tokenizer, saved in `folder`
    (from_pretrained reads it)."""
    import torch
    import transformers

    config_cls, kwargs = SHAPES[shape]
    tok = byte_tokenizer(kwargs.get("vocab_size"))
    kwargs = dict(kwargs, vocab_size=kwargs.get("vocab_size", len(tok)), **overrides)
    config = getattr(transformers, config_cls)(**kwargs, eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id,
                                               bos_token_id=None)
    torch.manual_seed(seed)
    model = transformers.AutoModelForCausalLM.from_config(config)
    if dtype is not None:
        model = model.to(dtype)
    model.save_pretrained(folder)
    tok.save_pretrained(folder)
    return Path(folder)

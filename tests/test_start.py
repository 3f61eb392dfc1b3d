"""A run's start: the device, the 4-bit default, the multi-process refusal, the quiet libraries."""
import logging
import warnings

import pytest
import torch

import engine
from stages import plumbing
import train
from envs import UserError


@pytest.mark.parametrize("cuda, n_params, want", [
    (True, 135_000_000, False),  # the bundled model: NF4 saves ~0.2 GB and costs speed
    (True, 10**9, True), (True, 7_000_000_000, True),
    (False, 7_000_000_000, False),  # bitsandbytes' fast kernels are CUDA's
    (True, None, False),  # size unknown
])
def test_4bit_by_default_only_where_it_pays(cuda, n_params, want):
    assert engine.default_4bit(cuda, n_params) is want


def test_4bit_default_reads_the_size_from_the_config(tiny_model, monkeypatch):
    model, _ = engine.load_model(tiny_model)
    assert engine.count_parameters(tiny_model) == sum(p.numel() for p in model.parameters())
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    assert train.use_4bit(train.Settings(model=tiny_model)) is False  # a tiny model, even on CUDA
    monkeypatch.setattr(engine, "count_parameters", lambda name: 8 * 10**9)
    assert train.use_4bit(train.Settings(model=tiny_model)) is True
    assert train.use_4bit(train.Settings(model=tiny_model, load_in_4bit=False)) is False  # the flag wins


def test_mps_is_used_where_there_is_no_cuda(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    monkeypatch.setattr(torch.backends.mps, "is_available", lambda: True)
    assert engine.default_device() == "mps"
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    assert engine.default_device() == "cuda"


def test_multi_process_launch_needs_trl(monkeypatch, tmp_path):
    monkeypatch.setenv("WORLD_SIZE", "2")  # as `accelerate launch --num_processes 2` sets it
    with pytest.raises(UserError, match=r"launched as 2 processes .*\(lab/trl_grpo.py\) shares work"):
        train.main(["collect", "--num-games", "1", "--out", str(tmp_path)])
    plumbing.check_run(train.Settings(out=str(tmp_path)), processes=True)  # TRL's trainer shares the work
    monkeypatch.setenv("WORLD_SIZE", "1")
    plumbing.check_single_process()


def test_quiet_start_drops_the_two_notes_only(tiny_model, caplog):
    log = logging.getLogger("bitsandbytes.backends.cpu.ops")
    with caplog.at_level(logging.WARNING):
        log.warning("Failed to load CPU gemm_4bit_forward from kernels-community: %s. Please make sure you "
                    "already `pip install kernels` and the kernels >= 0.11.1", "No module named 'kernels'")
        log.warning("another bitsandbytes warning")
    assert [r.getMessage() for r in caplog.records] == ["another bitsandbytes warning"]
    model, _ = engine.load_model(tiny_model)
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        engine.quiet_libraries()  # again: catch_warnings restores the filters it found
        assert model.is_gradient_checkpointing is False  # transformers 5 warns on this read (peft reads it)
        warnings.warn("something else is deprecated", FutureWarning)
    assert [str(w.message) for w in seen] == ["something else is deprecated"]

"""VeOmni's training step under check_step (python/examples/veomni_step.py): VeOmni's patched
Qwen3 (build_foundation_model), parallel state, MainCollator, Ulysses flash attention wrapper,
reduce_sequence_parallel_loss and its trainer's mean_global_loss — on CPU gloo ranks, against
the pinned release (requirements.txt). The path passes the property (DP × Ulysses, unequal
valid tokens, gradient accumulation, float64 and float32; Qwen3, gpt-oss's sinks, Gemma 3's
sliding windows); the one mistake the example plants
is found and named; and the CPU kernel under VeOmni's wrapper (seqpar.testing.hf.flash_forward)
is flash-attn's varlen contract, checked against transformers' own masks."""
import os
import sys

import pytest
import torch

HERE = os.path.dirname(os.path.abspath(__file__))
SRC = os.path.dirname(os.path.dirname(HERE))
sys.path.insert(0, os.path.join(SRC, "python"))

import seqpar.testing as spt  # noqa: E402
from seqpar.testing.hf import flash_forward  # noqa: E402
from seqpar.testing.step import StepScenario  # noqa: E402

STEP = os.path.join(SRC, "python", "examples", "veomni_step.py")
QWEN3 = os.path.join(HERE, "data", "hf_configs", "qwen3-8b.json")


def step(args=""):
    return "%s:make_step(%s)" % (STEP, args)


def test_veomni_path_passes_the_property():
    stats = {}
    spt.check_step(step(), QWEN3, attn="seqpar_varlen", max_ring=1, ulysses_degrees=(2, 4),
                   dtypes=("f64", "f32"), seed=0, max_examples=20, deadline=240, stats=stats)
    assert stats["examples"] == 20 and stats["failures"] == 0


@pytest.mark.parametrize("config", ["gpt-oss-20b.json", "gemma3-4b.json"])
def test_sinks_and_sliding_windows_pass(config):
    # gpt-oss: VeOmni hands the kernel the rank's slice of the sinks (DeepSpeed's ALST
    # wrapper does not); Gemma 3: its sliding-window layers under Ulysses
    stats = {}
    spt.check_step(step(), os.path.join(HERE, "data", "hf_configs", config),
                   attn="seqpar_varlen", max_ring=1, ulysses_degrees=(2, 4),
                   dtypes=("f64", "f32"), seed=1, max_examples=8, deadline=240, stats=stats)
    assert stats["examples"] == 8 and stats["failures"] == 0


@pytest.mark.parametrize("dp,ulysses", [(1, 2), (2, 2)])
def test_missing_sp_division_is_named(dp, ulysses):
    scn = StepScenario(dp=dp, ulysses=ulysses, ring=1, dtype="f64", seed=3,
                       rows=[[[[[7, 1], [5, 2]], [[9, 0]]]]] * dp)
    ok, text = spt.run_step(step("'no_sp_divide'"), QWEN3, scn, attn="seqpar_varlen",
                            deadline=240)
    assert not ok
    assert "every rank's gradient is 2 × the reference's = the SP degree" in text, text
    assert "every rank logged 2 × the reference's loss = the SP degree" in text, text


def test_healthy_example_with_unequal_replicas_passes():
    # DP replicas with unequal valid labels (replica 0: documents of 9, 4 and 6 tokens; replica
    # 1: of 3 and 4), two micro-batches each: mean_global_loss weighs every token by the step's
    # global count
    scn = StepScenario(dp=2, ulysses=2, ring=1, dtype="f64", seed=5,
                       rows=[[[[[9, 1], [4, 2]]], [[[6, 0]]]], [[[[3, 1]]], [[[4, 3]]]]])
    ok, text = spt.run_step(step(), QWEN3, scn, attn="seqpar_varlen", deadline=240)
    assert ok, text


def _reference(q, k, v, doc, window=None, causal=True, softcap=None):
    S = q.shape[1]
    i = torch.arange(S)
    seen = doc[:, None] == doc[None, :]
    if causal:
        seen &= i[:, None] >= i[None, :]
    if window:
        seen &= (i[:, None] - i[None, :]).abs() < window
    rep = q.shape[2] // k.shape[2]
    kk, vv = k.repeat_interleave(rep, 2), v.repeat_interleave(rep, 2)
    s = torch.einsum("bqhd,bkhd->bhqk", q, kk) * q.shape[-1] ** -0.5
    if softcap:
        s = softcap * torch.tanh(s / softcap)
    s = s.masked_fill(~seen, float("-inf"))
    return torch.einsum("bhqk,bkhd->bqhd", s.softmax(-1), vv)


@pytest.mark.parametrize("window,causal,softcap", [(None, True, None), (3, True, None),
                                                    (None, False, 5.0), (4, False, None)])
def test_flash_forward_is_the_varlen_contract(window, causal, softcap):
    g = torch.Generator().manual_seed(7)
    lens = [5, 1, 7, 3]
    S = sum(lens)
    q = torch.randn(1, S, 4, 8, generator=g, dtype=torch.float64)
    k = torch.randn(1, S, 2, 8, generator=g, dtype=torch.float64)
    v = torch.randn(1, S, 2, 8, generator=g, dtype=torch.float64)
    doc = torch.cat([torch.full((n,), j) for j, n in enumerate(lens)])
    cu = torch.tensor([0, 5, 6, 13, 16], dtype=torch.int32)
    pos = torch.cat([torch.arange(n) for n in lens])[None]
    want = _reference(q, k, v, doc, window, causal, softcap)
    for kw in ({"cu_seq_lens_q": cu}, {"position_ids": pos}):
        got = flash_forward(q, k, v, None, S, is_causal=causal, sliding_window=window,
                            softcap=softcap, **kw)
        assert got.shape == q.shape and got.dtype == torch.float64
        assert torch.allclose(got, want, rtol=0, atol=1e-13), (kw.keys(), (got - want).abs().max())


def test_flash_forward_refuses_a_padding_mask():
    q = torch.zeros(1, 4, 2, 8)
    with pytest.raises(ValueError, match="padding attention_mask"):
        flash_forward(q, q, q, torch.tensor([[1, 1, 0, 0]]), 4)

"""The SP code users pip-install, under seqpar.testing's property (frameworks.py calls each
installed package's own code; requirements.txt pins the versions). Each framework and path
runs ≥ 100 drawn examples on gloo CPU ranks, with what it does not support declared (and why,
from the framework's own code); a negative control per framework shows the property sees its
output (a layout the code does not implement must fail). Seeds fixed.

The examples per path: $SEQPAR_FRAMEWORK_EXAMPLES (default 100)."""
import importlib.metadata
import importlib.util
import os
import subprocess
import sys

import hypothesis
import pytest

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, "..", "..", "python"))
import seqpar.testing as spt  # noqa: E402

REF = os.path.join(HERE, "frameworks.py")
N = int(os.environ.get("SEQPAR_FRAMEWORK_EXAMPLES", "100"))


def _check(name, supports, seed=0, max_world=4):
    stats = {}
    spt.check(REF + ":" + name, max_world=max_world, max_examples=N, seed=seed,
              supports=supports, stats=stats)
    assert stats["failures"] == 0, stats
    assert stats["examples"] >= N * 0.9, stats  # drawn, run and judged, not rejected
    return stats


def _fails(name, supports, max_world=4, seed=0, examples=None, settings=None):
    with pytest.raises(spt.SpAttentionFailure) as e:
        spt.check(REF + ":" + name, max_world=max_world, max_examples=examples or N, seed=seed,
                  supports=supports, settings=settings)
    return str(e.value)


# A framework that raises does so on every example it cannot run, and every raising example
# restarts the rank pool: shrinking it costs ~40 s and changes none of the words asserted (the
# exception, the message, the Ulysses degree), so such tests stop at the first failing example.
NO_SHRINK = {"phases": [hypothesis.Phase.explicit, hypothesis.Phase.reuse,
                        hypothesis.Phase.generate]}


def ulysses_only(profile):
    return dict(ring=False, profiles=(profile,))


# VeOmni's Ulysses (prepare_ulysses_qkv / restore_ulysses_output): no ring in this path.
@pytest.mark.parametrize("profile", ["veomni", "xorl"])
def test_veomni_ulysses(profile):
    _check("veomni_ulysses", ulysses_only(profile))


def test_veomni_ulysses_under_a_ring_layout_is_reported():
    report = _fails(*FINDINGS["veomni_ulysses_under_a_ring"])
    head = report.strip().splitlines()
    assert "differs on" in head[0] and "ring 2" in head[1], report


# DeepSpeed's DistributedAttention (deepspeed.sequence.layer), Ulysses only. Every dtype is
# drawn for every framework: torch 2.x's gloo moves bfloat16.
@pytest.mark.parametrize("profile", ["deepspeed", "xorl"])
def test_deepspeed_distributed_attention(profile, deepspeed_comm_built):
    _check("deepspeed_ulysses", ulysses_only(profile))


# DeepSpeed ALST's Hugging Face Ulysses attention (UlyssesSPAttentionHF), Ulysses only; it
# repeats KV heads itself when U > Hkv.
@pytest.mark.parametrize("profile", ["deepspeed", "xorl"])
def test_deepspeed_alst_hf_attention(profile, deepspeed_comm_built):
    _check("deepspeed_alst", ulysses_only(profile))


# torch's own context-parallel ring: ring only; one causal sequence (no documents: its causal
# mask is the whole row's) of a length its load balancer splits evenly (2R chunks, no padding).
# Every dtype: float16's gradients in its subnormal range (|x| < 6.1e-5, stored with an absolute
# spacing of 2^-24: grad.v.local 7.2e-8 off at 9.3e-6) are within the bound's subnormal floor.
TORCH_CP = dict(ulysses=False, multiple_docs=False, padding=False, dtypes=("f32", "bf16", "f16"))


@pytest.mark.parametrize("layout", ["zigzag", "contiguous"])
def test_torch_context_parallel_ring(layout):
    # zigzag = torch's head-tail load balancing on, contiguous = off.
    _check("torch_cp_ring", dict(TORCH_CP, layouts=(layout,)))


def test_torch_context_parallel_ring_on_the_other_layout_is_reported():
    # The ring with load balancing off, fed zigzag shards: the causal masks are the wrong ones.
    report = _fails(*FINDINGS["torch_cp_ring_no_load_balance"])
    assert "differs on" in report.strip().splitlines()[0], report


def test_torch_public_context_parallel_refuses_the_cpu_kernel():
    """The measured reason the ring above is called below the public API: context_parallel()
    dispatches only the CUDA SDPA kernels (rerun here, on 2 gloo ranks)."""
    p = subprocess.run([sys.executable, os.path.join(HERE, "torch_cp_public.py")],
                       capture_output=True, text=True, timeout=300)
    assert p.returncode == 0, p.stdout + p.stderr
    assert "does not have a sharding strategy registered" in p.stdout, p.stdout + p.stderr


# yunchang's LongContextAttention (USP: Ulysses × ring) with its torch backend: forward only
# (its torch backends raise in backward), one document (varlen needs flash-attn), U dividing the
# KV heads (comm/all_to_all.py asserts it), no SP padding (its extract functions split evenly).
# Its torch backend in float32; in bf16/f16 below (a finding).
YUNCHANG = dict(backward=False, multiple_docs=False, padding=False, kv_heads_below_ulysses=False,
                dtypes=("f32",))


@pytest.mark.parametrize("layout", ["zigzag", "contiguous"])
def test_yunchang_usp(layout):
    _check("yunchang_usp", dict(YUNCHANG, layouts=(layout,)))


# A finding: yunchang 0.6.4's torch backend rounds each ring block's LSE to the input dtype
# before its (float32) merge (kernels/attention.py: `lse = lse.to(q.dtype)`), so in bf16/f16
# with sharp scores its output leaves the error model of a kernel that keeps the LSE in float32
# (here 2.2× the bound on a pinned example). With only that cast removed, yunchang passes the
# property in every dtype and layout: the cast is the whole excess.
_YC_BF16 = {"causal": True, "chunk": 0, "docs": [12], "dtype": "bf16", "head_dim": 8, "heads": 2,
            "kv_heads": 1, "layout": "contiguous", "profile": "xorl", "q_scale": 16.0, "ring": 2,
            "seed": 0, "sinks": False, "softcap": 0.0, "ulysses": 1, "window_ahead": -1,
            "window_back": -1}


def _run_one(name, scenario, supports):
    from seqpar.testing import _make_runner
    from seqpar.testing.scenario import Scenario, Supports
    runner = _make_runner(REF + ":" + name, None, 60.0, "fork", None, None, None)
    scn = Scenario(**scenario)
    out = runner.run(scn, Supports.of(supports))
    return out.ok, ("" if out.ok else runner.report(scn, out))


def test_yunchang_torch_backend_rounds_the_lse_in_bf16():
    every = dict(YUNCHANG, dtypes=("f32", "bf16", "f16"))
    ok, report = _run_one("yunchang_usp", _YC_BF16, every)
    assert not ok and "out.local differs" in report, report
    # seqpar names the cause: the emulated ring with each step's LSE rounded to bf16 reproduces
    # the failing rows.
    assert "steps' LSEs were rounded to bf16" in report, report
    ok, report = _run_one("yunchang_usp_lse_f32", _YC_BF16, every)
    assert ok, report


@pytest.mark.parametrize("layout", ["zigzag", "contiguous"])
def test_yunchang_usp_every_dtype_with_its_lse_in_float32(layout):
    _check("yunchang_usp_lse_f32", dict(YUNCHANG, layouts=(layout,),
                                        dtypes=("f32", "bf16", "f16")))


# Today's attention options (docs/attention.md). yunchang's main use is bidirectional attention
# (diffusion transformers): its basic ring runs it; its zigzag ring refuses it (an assertion:
# "zigzag ring is meaningless for causal=False").
def test_yunchang_usp_bidirectional():
    stats = {}
    spt.check(REF + ":yunchang_usp", max_world=4, max_examples=60, seed=0, stats=stats,
              supports=dict(YUNCHANG, layouts=("contiguous",), causal=False, bidirectional=True))
    assert stats["failures"] == 0 and stats["examples"] >= 54, stats


def test_yunchang_zigzag_ring_refuses_bidirectional():
    report = _fails(*FINDINGS["yunchang_zigzag_ring_bidirectional"])
    assert " raised AssertionError in forward" in report and "meaningless" in report, report


# A finding: yunchang 0.6.4's torch attention backend (pytorch_attn_forward) takes window_size
# and softcap and passes neither to the kernel — a sliding window and soft-capping are ignored
# without an error (with flash-attn on CUDA they reach the kernel). seqpar names both.
def test_yunchang_torch_backend_ignores_the_window():
    report = _fails(*FINDINGS["yunchang_torch_backend_window"])
    assert "attention without its sliding window" in report, report


def test_yunchang_torch_backend_ignores_soft_capping():
    report = _fails(*FINDINGS["yunchang_torch_backend_softcap"])
    assert "attention without its logit soft-capping" in report, report


# gpt-oss's sinks through DeepSpeed ALST's Hugging Face Ulysses wrapper, around transformers'
# own gpt-oss eager attention (module.sinks, s_aux): the wrapper scatters the heads but hands the
# attention the module — and s_aux — with every head's sinks. A finding: at U > 1 the eager
# attention raises (it concatenates H sink columns to H/U heads' scores); a kernel that takes
# s_aux without checking its length would read the first H/U sinks on every rank. Sliced to the
# rank's heads around the attention (what the wrapper would have to do), it passes, the sinks'
# gradient included. World ≤ 2: every DeepSpeed pool start costs ~25 s here.
GPT_OSS = dict(sinks=True, ring=False, profiles=("deepspeed", "xorl"))


def test_deepspeed_alst_hands_gpt_oss_every_heads_sinks(deepspeed_comm_built):
    report = _fails(*FINDINGS["deepspeed_alst_gpt_oss_every_heads_sinks"], examples=30,
                    settings=NO_SHRINK)
    assert " raised RuntimeError in forward" in report, report
    assert "Sizes of tensors must match" in report and "ulysses 2" in report, report


def test_deepspeed_alst_gpt_oss_sinks_sliced_to_the_ranks_heads(deepspeed_comm_built):
    stats = {}
    spt.check(REF + ":deepspeed_alst_gpt_oss_sliced", max_world=2, max_examples=30, seed=0,
              supports=GPT_OSS, stats=stats)
    assert stats["failures"] == 0 and stats["examples"] >= 27, stats


def test_yunchang_usp_basic_ring_on_zigzag_shards_is_reported():
    report = _fails(*FINDINGS["yunchang_usp_basic_on_zigzag"])
    assert "differs on" in report.strip().splitlines()[0], report


def test_xorl_package_carries_no_context_parallel_code():
    """PyPI's xorl 0.1.1 (the pinned version) is another project's name: its wheel holds the
    package `turl` (a small trainer), no sequence- or context-parallel code. The xorl whose SP
    collator seqpar reproduces is not on PyPI; its behaviour is tested from committed outputs."""
    files = [str(f) for f in importlib.metadata.files("xorl")]
    assert any(f.startswith("turl/") for f in files), files
    assert importlib.util.find_spec("xorl") is None
    sources = [os.path.basename(f)[:-3] for f in files if f.endswith(".py")]
    assert not [f for f in sources if any(w in f.lower() for w in ("ring", "ulysses", "context",
                                                                    "sequence", "attention"))], files


# The draw spaces of the healthy runs above at their budget of N examples (the paths with their
# own smaller budgets, yunchang's bidirectional run and gpt-oss's sliced sinks, are not here),
# and the frameworks' findings, each a (path, supports, max_world) the property must fail on:
# bench/budgets.py --only frameworks measures how many examples the planted mistakes and these
# findings need in them (docs/development.md, "Test budgets").
HEALTHY_SPACES = {
    "ulysses only, veomni profile": ulysses_only("veomni"),
    "ulysses only, xorl profile": ulysses_only("xorl"),
    "ulysses only, deepspeed profile": ulysses_only("deepspeed"),
    "torch CP ring, zigzag": dict(TORCH_CP, layouts=("zigzag",)),
    "torch CP ring, contiguous": dict(TORCH_CP, layouts=("contiguous",)),
    "yunchang USP, zigzag": dict(YUNCHANG, layouts=("zigzag",)),
    "yunchang USP, contiguous": dict(YUNCHANG, layouts=("contiguous",)),
}
FINDINGS = {
    "veomni_ulysses_under_a_ring": ("veomni_ulysses", dict(dtypes=("f32",)), 4),
    "torch_cp_ring_no_load_balance": ("torch_cp_ring_no_load_balance",
                                      dict(TORCH_CP, layouts=("zigzag",)), 4),
    "yunchang_usp_basic_on_zigzag": ("yunchang_usp_basic",
                                     dict(YUNCHANG, layouts=("zigzag",), ulysses=False), 4),
    "yunchang_zigzag_ring_bidirectional": ("yunchang_usp", dict(
        YUNCHANG, layouts=("zigzag",), causal=False, bidirectional=True, ulysses=False), 4),
    "yunchang_torch_backend_window": ("yunchang_usp",
                                      dict(YUNCHANG, layouts=("contiguous",), window=True), 4),
    "yunchang_torch_backend_softcap": ("yunchang_usp",
                                       dict(YUNCHANG, layouts=("contiguous",), softcap=True), 4),
    "deepspeed_alst_gpt_oss_every_heads_sinks": ("deepspeed_alst_gpt_oss", GPT_OSS, 2),
}

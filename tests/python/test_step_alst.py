"""DeepSpeed ALST's whole Hugging Face path under check_step (python/examples/alst_step.py): a
small Qwen3 from tests/python/data/hf_configs/qwen3-8b.json, DeepSpeed's UlyssesSPAttentionHF
and UlyssesSPDataLoaderAdapter, transformers' deepspeed_sp_compute_loss, a DeepSpeed engine
(float32; ZeRO 0 and 1) — on CPU gloo ranks. What seqpar finds in the pinned versions
(requirements.txt) is asserted here, so that a release that changes it turns this test red:

- the gradients are SP-degree times the loss's (ZeRO 0 and 1);
- a micro-batch without a valid label makes the loss a Python float, which has no backward;
- with DP × SP on gloo, torch's all_gather backward raises on every SP group but the first,
  and with that fixed the DP replicas' means weigh the same;
- with gradient accumulation, the micro-batches' means are averaged with equal weights;

and with the two workarounds (make_step(fixed=True)) the path passes the property without
accumulation. The step's classic mistakes are found and named."""
import os
import sys

import pytest

HERE = os.path.dirname(os.path.abspath(__file__))
SRC = os.path.dirname(os.path.dirname(HERE))
sys.path.insert(0, os.path.join(SRC, "python"))

import seqpar.testing as spt  # noqa: E402
from seqpar.testing.step import StepScenario  # noqa: E402

pytestmark = pytest.mark.usefixtures("deepspeed_comm_built")

STEP = os.path.join(SRC, "python", "examples", "alst_step.py")
QWEN3 = os.path.join(HERE, "data", "hf_configs", "qwen3-8b.json")


def step(args=""):
    return "%s:make_step(%s)" % (STEP, args)


def run(args, dp=1, ulysses=2, dtype="f64", rows=None, seed=1):
    scn = StepScenario(dp=dp, ulysses=ulysses, ring=1, dtype=dtype, seed=seed,
                       rows=rows or [[[[[7, 1], [5, 2]], [[9, 0]]]]] * dp)
    ok, text = spt.run_step(step(args), QWEN3, scn, attn="seqpar_varlen", deadline=240)
    return ok, text


def test_fixed_path_passes_the_property():
    stats = {}
    spt.check_step(step("fixed=True"), QWEN3, attn="seqpar_varlen", max_dp=1, max_ring=1,
                   ulysses_degrees=(2, 4), accumulation=False, dtypes=("f64", "f32"), seed=0,
                   max_examples=25, deadline=240, stats=stats)
    assert stats["examples"] == 25 and stats["failures"] == 0


@pytest.mark.parametrize("ulysses,dtype,zero", [(2, "f32", 0), (2, "f32", 1), (2, "f32", 2),
                                                 (4, "f64", 0)])
def test_gradients_are_sp_degree_times_the_loss(ulysses, dtype, zero):
    ok, text = run("zero_stage=%d" % zero, ulysses=ulysses, dtype=dtype)
    assert not ok
    assert "every rank's gradient is %d × the reference's = the SP degree" % ulysses in text, text
    assert "the loss differs" not in text, text


@pytest.mark.parametrize("ulysses", [2, 4])
def test_zero3_gradients_are_right(ulysses):
    # ZeRO 3's partitioned reduction averages over every rank, SP ranks included: the same
    # path's gradients are right there (read through ctx.grads: safe_get_full_grad of each
    # partitioned parameter), and the workaround for ZeRO 0-2 makes them 1/SP
    ok, text = run("zero_stage=3", ulysses=ulysses, dtype="f32")
    assert ok, text
    ok, text = run("zero_stage=3, fixed=True", ulysses=ulysses, dtype="f32")
    assert not ok
    assert "every rank's gradient is %g × the reference's = 1/the SP degree" % (1 / ulysses) \
        in text, text


def test_a_micro_batch_without_labels_has_no_backward():
    rows = [[[[[6, 1], [5, 0]]], [[[4, 9]]]]]   # the second micro-batch: every label masked
    ok, text = run("", rows=rows)
    assert not ok
    assert "raised AttributeError" in text and "'float' object has no attribute 'backward'" \
        in text, text


def test_accumulation_weights_micro_batches_equally():
    rows = [[[[[9, 1], [5, 0]]], [[[4, 1]]]]]   # 12 labels, then 3
    ok, text = run("fixed=True", rows=rows)
    assert not ok
    assert "the logged loss is exactly the mean of the micro-batches' means" in text, text
    assert "every rank's gradient is exactly that of the mean of the micro-batches' means" in \
        text, text


MISTAKES = {
    "tutorial": "logged NaN: SP rank",
    "local_mean": "the logged loss is exactly the loss averaged over the rank's own valid labels",
    "shift_after": "the logged loss is exactly the labels shifted after sharding",
}


@pytest.mark.parametrize("mistake", sorted(MISTAKES))
def test_each_step_mistake_is_named(mistake):
    # a masked document at the end: the last SP rank holds no valid label
    rows = [[[[[8, 0], [4, 4]], [[5, 1], [3, 0]]]]]
    ok, text = run("%r, fixed=True" % mistake, ulysses=4, rows=rows)
    assert not ok
    assert MISTAKES[mistake] in text, text


def test_gemma3_passes_the_fixed_path():
    """Gemma 3's sliding-window layers under Ulysses, and its loss taking the adapter's
    shift_labels (no second shift)."""
    stats = {}
    spt.check_step(step("fixed=True"), os.path.join(HERE, "data", "hf_configs", "gemma3-4b.json"),
                   attn="seqpar_varlen", max_dp=1, max_ring=1, ulysses_degrees=(2, 4),
                   accumulation=False, seed=0, max_examples=8, deadline=240, stats=stats)
    assert stats["examples"] == 8 and stats["failures"] == 0


def test_gpt_oss_sinks_reach_the_core_for_every_head():
    """UlyssesSPAttentionHF passes the layer's sinks of all heads to a core attention that holds
    the rank's slice of them (tests/python/test_frameworks.py finds it on the attention alone)."""
    scn = StepScenario(dp=1, ulysses=2, ring=1, rows=[[[[[6, 1]]]]], seed=0)
    ok, text = spt.run_step(step("fixed=True"), os.path.join(HERE, "data", "hf_configs",
                                                             "gpt-oss-20b.json"),
                            scn, attn="seqpar_varlen", deadline=240)
    assert not ok
    assert "raised RuntimeError" in text and "is invalid for input of size 16" in text, text


def test_dp_times_sp_on_gloo_stops_in_torchs_all_gather_backward():
    """torch's differentiable all_gather, on gloo, scatters with a group rank where a global rank
    is expected: the second SP group's backward raises."""
    ok, text = run("", dp=2, rows=[[[[[9, 1], [5, 0]]]], [[[[4, 1]]]]])
    assert not ok
    assert "ranks 2, 3 raised ValueError" in text and "Global rank 0 is not part of group" in \
        text, text


@pytest.mark.parametrize("equal", [True, False])
def test_dp_replicas_weigh_the_same(equal):
    """With that backward fixed: each replica logs its own mean, and the gradients are right
    when the replicas hold as many valid labels (12 and 12) and not when they do not (12, 3)."""
    other = [[[[6, 0], [8, 1]]]] if equal else [[[[4, 1]]]]
    ok, text = run("fixed=True", dp=2, rows=[[[[[9, 1], [5, 0]]]], other])
    assert not ok
    assert "the logged loss is exactly the DP replica's own mean" in text, text
    assert ("the gradient of" in text.splitlines()[0]) != equal, text
    assert equal or "every rank's gradient is exactly that of the mean of the DP replicas' " \
        "means" in text, text

"""The Hugging Face Trainer's own SP loop under check_step (python/examples/trainer_step.py):
`Trainer.train()` with accelerate's ParallelismConfig(sp_backend="deepspeed") — DeepSpeed's
UlyssesSPAttentionHF and UlyssesSPDataLoaderAdapter, transformers' deepspeed_sp_compute_loss, a
DeepSpeed engine — on CPU gloo ranks, against the pinned releases (requirements.txt). What
seqpar finds there is asserted, so that a release that changes it turns this test red: the
loss the Trainer reports is right, and every gradient is the SP degree times the loss's (the
finding of the ALST path, docs/testing.md, through the Trainer's own loop); and with more than
one row per rank the step raises in transformers' loss (a strided shift_labels, .view(-1))."""
import os
import sys

import pytest

HERE = os.path.dirname(os.path.abspath(__file__))
SRC = os.path.dirname(os.path.dirname(HERE))
sys.path.insert(0, os.path.join(SRC, "python"))

import seqpar.testing as spt  # noqa: E402
from seqpar.testing.step import StepScenario  # noqa: E402

pytestmark = pytest.mark.usefixtures("deepspeed_comm_built")

STEP = os.path.join(SRC, "python", "examples", "trainer_step.py") + ":make_step()"
QWEN3 = os.path.join(HERE, "data", "hf_configs", "qwen3-8b.json")


@pytest.mark.parametrize("ulysses,rows", [
    (2, [[[[[2, 0]]]]]),                                  # the shrunk case: one 2-token row
    (2, [[[[[7, 1], [5, 2], [3, 3]]]]]),                  # packed documents, prompts
    (4, [[[[[11, 1], [6, 0]]]]]),
])
def test_trainer_loss_right_gradients_times_sp(ulysses, rows):
    scn = StepScenario(dp=1, ulysses=ulysses, ring=1, dtype="f32", seed=2, rows=rows)
    ok, text = spt.run_step(STEP, QWEN3, scn, attn="seqpar_varlen", deadline=300)
    assert not ok, text
    assert "the loss differs" not in text, text
    assert ("every rank's gradient is %d × the reference's = the SP degree" % ulysses) in text, text


def test_trainer_step_refuses_what_it_does_not_map():
    scn = StepScenario(dp=2, ulysses=2, ring=1, dtype="f32", seed=2,
                       rows=[[[[[4, 1]]]], [[[[5, 1]]]]])
    ok, text = spt.run_step(STEP, QWEN3, scn, attn="seqpar_varlen", deadline=300)
    assert not ok and "--max-dp 1 --no-accumulation --dtypes f32" in text, text


def test_trainer_raises_on_more_than_one_row_per_rank():
    """per_device_train_batch_size > 1: the adapter's sequence shard of a [B, L] batch is a
    strided view, and transformers' ForCausalLMLoss calls .view(-1) on the shift_labels it is
    given — the Trainer's SP step raises before any gradient."""
    scn = StepScenario(dp=1, ulysses=2, ring=1, dtype="f32", seed=2,
                       rows=[[[[[7, 1], [5, 2]], [[9, 0], [3, 3]]]]])
    ok, text = spt.run_step(STEP, QWEN3, scn, attn="seqpar_varlen", deadline=300)
    assert not ok and "raised RuntimeError" in text, text
    assert "view size is not compatible with input tensor's size and stride" in text, text
    assert "shift_labels = shift_labels.view(-1)" in text, text

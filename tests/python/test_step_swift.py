"""ms-swift's sequence-parallel training step under check_step (python/examples/swift_step.py):
ms-swift's SequenceParallel (its mesh, input and label sharding, Ulysses attention wrapper),
per_token_loss_func_sp with GatherLoss, and Seq2SeqTrainer.compute_loss with transformers'
_get_num_items_in_batch — on CPU gloo ranks, against the pinned release (requirements.txt,
installed without its declared dependencies). The default SFT path passes the property (DP ×
Ulysses, unequal valid tokens, gradient accumulation, float64 and float32; Qwen3 and Gemma 3's
sliding windows; per-token loss weights as its loss_scale); the two settings that change the
loss's weighting are found and named; gpt-oss's sinks reach the kernel unsliced."""
import os
import sys

import pytest

HERE = os.path.dirname(os.path.abspath(__file__))
SRC = os.path.dirname(os.path.dirname(HERE))
sys.path.insert(0, os.path.join(SRC, "python"))

import seqpar.testing as spt  # noqa: E402
from seqpar.testing.step import StepScenario  # noqa: E402

STEP = os.path.join(SRC, "python", "examples", "swift_step.py")
CONFIGS = os.path.join(HERE, "data", "hf_configs")
QWEN3 = os.path.join(CONFIGS, "qwen3-8b.json")

# Three replicas with unequal valid labels, two micro-batches each (replica 0: documents of 9, 4
# and 6 tokens, replica 1: 3 and 4, replica 2: 5 and 2)
UNEQUAL = [[[[[9, 1], [4, 2]]], [[[6, 0]]]], [[[[3, 1]]], [[[4, 3]]]], [[[[5, 1]]], [[[2, 0]]]]]


def step(args=""):
    return "%s:make_step(%s)" % (STEP, args)


def run(args, dp, ulysses, config=QWEN3, rows=None):
    scn = StepScenario(dp=dp, ulysses=ulysses, ring=1, dtype="f64", seed=5,
                       rows=rows or UNEQUAL[:dp])
    return spt.run_step(step(args), config, scn, attn="seqpar_varlen", deadline=240)


@pytest.mark.parametrize("config,examples", [("qwen3-8b.json", 20), ("gemma3-4b.json", 8)])
def test_swift_sft_path_passes_the_property(config, examples):
    # the drawn Qwen3 and Gemma 3 have 2 KV heads: ms-swift runs Ulysses 2 (a degree of 4 would
    # put a ring of 2 under it, whose kernel needs flash-attn)
    stats = {}
    spt.check_step(step(), os.path.join(CONFIGS, config), attn="seqpar_varlen", max_ring=1,
                   ulysses_degrees=(2,), dtypes=("f64", "f32"), seed=0, max_examples=examples,
                   deadline=240, stats=stats)
    assert stats["examples"] == examples and stats["failures"] == 0


def test_loss_scale_is_sharded_with_the_labels():
    # check_step's per-token loss weights as ms-swift's loss_scale: padded, rolled and split by
    # prepare_inputs, gathered and applied by compute_loss
    stats = {}
    spt.check_step(step(), QWEN3, attn="seqpar_varlen", max_ring=1, ulysses_degrees=(2,),
                   dtypes=("f64",), seed=2, max_examples=12, deadline=240, stats=stats,
                   loss_weights=True)
    assert stats["examples"] == 12 and stats["failures"] == 0


def test_unequal_replicas_with_accumulation_pass():
    ok, text = run("", 3, 2)
    assert ok, text


def test_no_loss_kwargs_divides_by_the_dp_degree():
    # ms-swift's own count (no num_items_in_batch from transformers) all-reduces the shards'
    # counts over the world: DDP's average then divides every replica's part by DP once more
    ok, text = run("model_accepts_loss_kwargs=False", 3, 2)
    assert not ok
    steps = "the mean of the accumulation steps' global means"
    assert "the logged loss is exactly 0.333333 × %s" % steps in text, text
    assert "every rank's gradient is exactly 0.333333 × that of %s" % steps in text, text
    assert "(1/the DP degree)" in text, text
    ok, text = run("model_accepts_loss_kwargs=False", 1, 2, rows=[UNEQUAL[0][:1]])
    assert ok, text   # without DP or accumulation the count is the replica's


def test_average_tokens_off_weighs_replicas_equally():
    ok, text = run("average_tokens_across_devices=False", 2, 2)
    assert not ok
    assert "the logged loss is exactly the mean of the DP replicas' means" in text, text
    assert "every rank's gradient is exactly that of the mean of the DP replicas' means" in text


def test_gpt_oss_sinks_reach_the_kernel_unsliced():
    # every head's sinks handed to the kernel that holds H/U heads after the all-to-all
    ok, text = run("", 1, 2, config=os.path.join(CONFIGS, "gpt-oss-20b.json"),
                   rows=[[[[[7, 1], [5, 2]]]]])
    assert not ok
    assert "raised" in text and "RuntimeError: shape '[1, 8, 1, 1]' is invalid for input of " \
        "size 16" in text, text


def test_ulysses_beyond_the_kv_heads_is_refused():
    ok, text = run("", 1, 4, rows=[[[[[7, 1], [5, 2]]]]])
    assert not ok
    assert "ms-swift runs Ulysses over gcd(KV heads 2, SP degree 4) ranks" in text, text

"""The frameworks' own Ulysses code under the property (frameworks.py loads it from a checkout:
$VEOMNI_DIR, $DEEPSPEED_DIR; skipped without one — CI has no network to fetch them; the runs of
record are in docs/testing.md). Seeds fixed."""
import os
import sys

import pytest

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, "..", "..", "python"))
import seqpar.testing as spt  # noqa: E402

REF = os.path.join(HERE, "frameworks.py")

veomni = pytest.mark.skipif(not os.environ.get("VEOMNI_DIR"), reason="needs VEOMNI_DIR")
deepspeed = pytest.mark.skipif(not os.environ.get("DEEPSPEED_DIR"), reason="needs DEEPSPEED_DIR")


@veomni
@pytest.mark.parametrize("profile", ["veomni", "xorl"])
def test_veomni_ulysses_passes_where_it_applies(profile):
    # VeOmni's Ulysses has no ring; gloo moves no bfloat16.
    spt.check(REF + ":veomni_ulysses", max_world=4, max_examples=200, seed=0,
              supports=dict(ring=False, profiles=(profile,), dtypes=("f32", "f16")))


@veomni
def test_veomni_ulysses_under_a_ring_layout_is_reported():
    with pytest.raises(spt.SpAttentionFailure) as e:
        spt.check(REF + ":veomni_ulysses", max_world=4, max_examples=200, seed=0,
                  supports=dict(dtypes=("f32",)))
    head = str(e.value).strip().splitlines()
    assert "differs on" in head[0] and "ring 2" in head[1], e.value


@deepspeed
@pytest.mark.parametrize("profile", ["deepspeed", "xorl"])
def test_deepspeed_distributed_attention_passes(profile):
    spt.check(REF + ":deepspeed_ulysses", max_world=4, max_examples=200, seed=0,
              supports=dict(ring=False, profiles=(profile,), dtypes=("f32", "f16")))

"""Every field of the context users read, exercised from the users' side: for each, an SP
attention that reads only that field (tests/python/ctx_readers.py) passes the property, and its
off-by-one twin fails it — so that a field handed to users wrong (a window one key short,
flash-attn's right side taken from the left, sinks of another head, …) cannot pass unnoticed,
and a user whose code follows the docs is told it is right."""
import os
import sys

import pytest

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, "..", "..", "python"))
sys.path.insert(0, HERE)

import seqpar.testing as spt  # noqa: E402

import ctx_readers  # noqa: E402

# What each reader is asked for: the options its field describes (and no other).
SUPPORTS = {
    "window_size": {"window": True, "bidirectional": True},
    "sliding_window": {"window": True},
    "window": {"window": True, "bidirectional": True},
    "chunk": {"chunk": True},
    "softcap": {"softcap": True},
    "sinks": {"sinks": True},
    "causal": {"bidirectional": True},
    "documents": {},
    "positions": {"window": True, "chunk": True},
}


@pytest.mark.parametrize("field", ctx_readers.FIELDS)
def test_reader_passes(field):
    stats = {}
    spt.check(ctx_readers.make(field), max_world=4, supports=SUPPORTS[field], max_examples=40,
              seed=11, stats=stats)
    assert stats["failures"] == 0 and stats["examples"] >= 35, stats


@pytest.mark.parametrize("field", ctx_readers.FIELDS)
def test_off_by_one_twin_fails(field):
    with pytest.raises(spt.SpAttentionFailure):
        spt.check(ctx_readers.make(field, twin=True), max_world=4, supports=SUPPORTS[field],
                  max_examples=150, seed=11)

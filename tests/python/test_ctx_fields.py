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


def test_draws_cover_what_they_claim():
    """The draws hold the variety the twins above rely on and the docs promise: windows shorter
    than, as long as and longer than a document; lopsided bidirectional windows; chunks whose
    tokens cross a ring shard's boundary and a Ulysses shard's (held by two ranks)."""
    from hypothesis import HealthCheck, given, settings
    from seqpar.testing.scenario import LayoutRefused, layout
    seqpar = os.environ.get("SEQPAR") or os.path.join(HERE, "..", "..", "build", "tools",
                                                      "seqpar")
    seen = set()

    @settings(max_examples=300, database=None, derandomize=True,
              suppress_health_check=list(HealthCheck))
    @given(spt.scenarios(max_world=4, supports={"window": True, "bidirectional": True,
                                                "chunk": True}))
    def draw(scn):
        docs = list(scn.docs)
        if scn.window_back >= 0:
            w = scn.window_back + 1 if scn.causal else scn.window_back
            seen.add("window shorter" if w < min(docs) else "")
            seen.add("window as long" if w in docs else "")
            seen.add("window longer" if w > max(docs) else "")
            if not scn.causal and scn.window_ahead >= 0 and scn.window_ahead != scn.window_back:
                seen.add("lopsided")
        if scn.chunk > 0 and scn.world > 1:
            try:
                lay = layout(scn, seqpar)
            except LayoutRefused:
                return
            owner = {}
            for r, toks in enumerate(lay.rank_tokens):
                for t in toks:
                    owner[t] = r
            pos, doc = lay.positions(), lay.doc_of()
            chunks = {}
            for t in range(lay.original_length):
                chunks.setdefault((doc[t], pos[t] // scn.chunk), set()).add(owner[t])
            for holders in chunks.values():
                rings = {r // scn.ulysses for r in holders}
                if len(rings) > 1:
                    seen.add("chunk across ring shards")
                if any(len([r for r in holders if r // scn.ulysses == j]) > 1 for j in rings):
                    seen.add("chunk across ulysses shards")
    draw()
    want = {"window shorter", "window as long", "window longer", "lopsided",
            "chunk across ring shards", "chunk across ulysses shards"}
    assert want <= seen, sorted(want - seen)

"""seqpar.testing against real torch code on gloo CPU ranks: the healthy zigzag ring passes, every
broken variant is found and shrunk to ≤ 4 ranks and ≤ 32 tokens with the right first stage, bad
user code is reported for what it is and leaves nothing running. Run by meson (suite python)
with SEQPAR set to the build's binary; seeds are fixed so CI sees the same examples every run."""
import json
import os
import subprocess
import sys

import hypothesis
import pytest

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.abspath(os.path.join(HERE, "..", ".."))
sys.path.insert(0, os.path.join(ROOT, "python"))
sys.path.insert(0, HERE)

import seqpar.testing as spt  # noqa: E402
from seqpar.testing.scenario import Scenario  # noqa: E402

import bad_code  # noqa: E402
import broken_attention  # noqa: E402

EXAMPLE = os.path.join(ROOT, "python", "examples", "zigzag_ring_attention.py")
ZIGZAG = {"layouts": ("zigzag",)}
# The healthy run's budget: 5× the most examples any planted mistake needed before the property
# found it (19, at seeds 0-2: bench/budgets.py, docs/development.md "Test budgets").
HEALTHY_EXAMPLES = int(os.environ.get("SEQPAR_HEALTHY_EXAMPLES", "100"))


def _children():
    """Live child processes of this test process (none may be left behind)."""
    me = str(os.getpid())
    kids = []
    for pid in os.listdir("/proc"):
        if not pid.isdigit():
            continue
        try:
            with open("/proc/%s/stat" % pid) as f:
                fields = f.read().rsplit(")", 1)[1].split()
        except OSError:
            continue
        if fields[1] == me and fields[0] != "Z":
            kids.append(int(pid))
    return kids


def _fail(impl, **kw):
    kw.setdefault("max_world", 4)
    kw.setdefault("supports", ZIGZAG)
    kw.setdefault("seed", 0)
    kw.setdefault("max_examples", 300)
    with pytest.raises(spt.SpAttentionFailure) as e:
        spt.check(impl, **kw)
    return str(e.value)


def _scenario_of(report):
    line = next(l for l in report.splitlines() if l.strip().startswith("re-run:"))
    return Scenario.from_json(json.loads(
        subprocess.run(["bash", "-c", "printf %s " + line.split("--scenario", 1)[1].strip()],
                       capture_output=True, text=True).stdout))


def test_healthy_zigzag_ring_passes():
    stats = {}
    spt.check(EXAMPLE + ":attention", max_world=4, supports=ZIGZAG,
              max_examples=HEALTHY_EXAMPLES, seed=1, stats=stats)
    assert stats["examples"] >= HEALTHY_EXAMPLES * 0.9, stats
    assert stats["failures"] == 0
    assert not _children()


# variant -> the first stage seqpar must name on the shrunk example ("raised": the user's
# code raised before any stage could be compared).
EXPECTED = {
    "no_kv_repeat": "raised",
    "blockwise_repeat": "k.repeated",
    "a2a_wrong_dims": "q.gathered",
    "local_cu": "lse",
    "zigzag_swapped": "lse",
    "no_scale": "lse",
    "lse_merge_no_max": "lse",
    "ring_src_off_by_one": "lse",
    "kv_grad_not_summed": "grad.v.local",
    # Which of the two the shrunk example shows first depends on the layout it shrinks to
    # (a ring taps lse before its merged output): the cause is checked instead.
    "no_causal": ("lse", "out.attn"),
}
CAUSE = {"no_causal": "without the causal mask",
         "zigzag_swapped": "each local document as [late chunk | early chunk]",
         "ring_src_off_by_one": "the ring source is off by one",
         "lse_merge_no_max": "merged through exp(lse) in bf16 without subtracting the maximum",
         "local_cu": "cu_seqlens computed from each rank's local position ids",
         "no_scale": "scores not multiplied by the scale"}


# Today's attention options (docs/attention.md): the example with every option declared passes;
# each mistake, drawn under the option it concerns, is found, shrunk and, where the dump engine
# fits it, named.
OPTIONS = dict(ZIGZAG, bidirectional=True, window=True, chunk=True, sinks=True, softcap=True)
OPTION_CASES = {
    # variant: (supports, causes the report may name — any one of them)
    "sinks_dropped": (dict(ZIGZAG, sinks=True), ("attention without its sinks",)),
    "sink_per_step": (dict(ZIGZAG, sinks=True, ulysses=False),
                      ("folded into every ring step's partial result",)),
    "sinks_first_slice": (dict(ZIGZAG, sinks=True, ring=False),
                          ("on every Ulysses rank (the first H/U)",)),
    "sinks_negated": (dict(ZIGZAG, sinks=True), ("sinks enter with the wrong sign",)),
    # Shrunk to 2 tokens, a window one key too wide is no window at all: either name is right.
    "window_off_by_one": (dict(ZIGZAG, window=True), ("a sliding window one key too wide",
                                                       "attention without its sliding window")),
    "positions_in_rank_order": (dict(ZIGZAG, window=True, chunk=True),
                                ("measured in the order the rank holds its rows",)),
    "softcap_without_scale": (dict(ZIGZAG, softcap=True),
                              ("logit capping applied before the softmax scale",
                               "scores not multiplied by the scale")),
    "causal_left_in": (dict(ZIGZAG, causal=False, bidirectional=True),
                       ("causal attention where the meta says non-causal",)),
    "positions_rebuilt_locally": (dict(ZIGZAG, chunk=True),
                                  ("chunk is measured in the rank's local positions",)),
    "window_per_call": (dict(ZIGZAG, window=True, ulysses=False),
                        ("window is measured in each ring step's own rows",)),
    "window_right_only": (dict(ZIGZAG, causal=False, bidirectional=True, window=True),
                          ("a bidirectional window on its right side only",)),
    "window_symmetric_right": (dict(ZIGZAG, causal=False, bidirectional=True, window=True),
                               ("a bidirectional window with its left side taken equal to its "
                                "right",)),
    "window_left_only": (dict(ZIGZAG, causal=False, bidirectional=True, window=True),
                         ("a bidirectional window on its left side only",)),
    "window_symmetric": (dict(ZIGZAG, causal=False, bidirectional=True, window=True),
                         ("a bidirectional window with its right side taken equal to its left",)),
    "softcap_after_mask": (dict(ZIGZAG, softcap=True),
                           ("logit capping applied after the mask",)),
    "sink_sigmoid_lse_kept": (dict(ZIGZAG, sinks=True),
                              ("renormalised by the sinks (out·sigmoid(lse − sink)) but whose "
                               "LSE is not",)),
}


def test_healthy_example_passes_every_attention_option():
    stats = {}
    spt.check(EXAMPLE + ":attention", max_world=4, supports=OPTIONS, max_examples=100, seed=3,
              stats=stats)
    assert stats["failures"] == 0 and stats["examples"] >= 90, stats
    assert not _children()


def _drawn(strategy, condition, draws=1000):
    """Whether `strategy` draws an example that meets `condition` within `draws` examples
    (hypothesis.find without its shrink phase: the first one found ends the search)."""
    from hypothesis import Phase, find, settings
    from hypothesis.errors import NoSuchExample
    try:
        find(strategy, condition, settings=settings(max_examples=draws, database=None,
                                                    derandomize=True, phases=[Phase.generate]))
        return True
    except NoSuchExample:
        return False


def test_options_are_drawn_and_shrink_toward_causal():
    """Every kind of scenario the attention options need is drawn: each kind is searched for on
    its own, up to 1000 draws. A common kind ends its search within a few draws; a draw that
    cannot make a kind fails its search whatever the other draws are, so no assertion rests on
    which examples one seed happens to give (a fixed sample of 150 did: renaming the test's
    inner function, which Hypothesis's derandomized seed is taken from, turned up samples with
    no chunk as long as a document and no symmetric bidirectional window)."""
    from hypothesis import given, settings
    options = spt.scenarios(max_world=4, supports=OPTIONS)
    bidir = lambda s: s.window_ahead >= 0  # noqa: E731
    wants = {
        "causal": lambda s: s.causal,
        "bidirectional": lambda s: not s.causal,
        "a causal window": lambda s: s.causal and s.window_back >= 0,
        "a bidirectional window": bidir,
        "a chunk": lambda s: s.chunk > 0,
        "sinks": lambda s: s.sinks,
        "capping": lambda s: s.softcap > 0,
        # Every option drawn off too: the shrink target is reachable.
        "no window": lambda s: s.window_back < 0,
        "no chunk": lambda s: s.chunk == 0,
        "no sinks": lambda s: not s.sinks,
        "no capping": lambda s: s.softcap == 0,
        # Bidirectional windows lopsided both ways and symmetric.
        "a window's right side shorter than its left":
            lambda s: bidir(s) and s.window_ahead < s.window_back,
        "a symmetric bidirectional window":
            lambda s: bidir(s) and s.window_ahead == s.window_back,
        "a window with no right side": lambda s: bidir(s) and s.window_ahead == 0,
        "a window with a right side": lambda s: bidir(s) and s.window_ahead > 0,
        # Chunks shorter than and as long as a document, and chunks whose boundaries fall inside
        # a document split over ranks (not at its ends).
        "a chunk shorter than a document": lambda s: 1 < s.chunk < max(s.docs),
        "a chunk as long as a document": lambda s: s.chunk >= max(s.docs) > 1,
        "a chunk boundary inside a split document":
            lambda s: s.chunk > 0 and s.world > 1 and any(1 < s.chunk < d and d % s.chunk
                                                          for d in s.docs),
    }
    # Windows around the documents' lengths, causal and bidirectional alike: shorter than and as
    # long as a document, and wider than one key (a window of 1 is as long as a one-token
    # document). Asked of each mask: a draw of one width for every window (1: causal windows all
    # 0 keys back, bidirectional ones 1) fails on the causal side.
    for causal, mask in ((True, "causal"), (False, "bidirectional")):
        wants[f"a {mask} window wider than a key, shorter than a document"] = (
            lambda s, c=causal: s.causal == c and s.window_back >= 0
            and 1 <= s.window_back < max(s.docs) - 1)
        wants[f"a {mask} window as long as a document"] = (
            lambda s, c=causal: s.causal == c and s.window_back >= 0
            and s.window_back >= max(s.docs) - 1 > 0)
    missing = [kind for kind, condition in wants.items() if not _drawn(options, condition)]
    assert not missing, f"not drawn in 1000 examples: {missing}"
    # Not declared, not drawn.
    default = spt.scenarios(max_world=4, supports=ZIGZAG)
    plain = []

    @settings(max_examples=50, database=None, derandomize=True)
    @given(default)
    def collect_plain(scn):
        plain.append(scn)
    collect_plain()
    assert all(s.causal and s.window_back < 0 and s.chunk == 0 and not s.sinks and not s.softcap
               for s in plain)


def test_code_without_padding_is_given_rows_that_need_none():
    """supports padding=False draws rows that seqpar's layout does not pad (not rows it pads,
    refused one by one), Ulysses and hybrid layouts among them as often as elsewhere."""
    from hypothesis import given, settings
    from seqpar.testing.scenario import find_seqpar, layout
    seqpar_bin = find_seqpar()
    seen = []

    @settings(max_examples=100, database=None, derandomize=True)
    @given(spt.scenarios(max_world=4, supports=dict(padding=False)))
    def collect(scn):
        seen.append(scn)
    collect()
    padded = [s.describe() for s in seen if layout(s, seqpar_bin).padded_length != s.tokens]
    assert not padded, padded[:3]
    assert sum(s.ulysses > 1 for s in seen) >= len(seen) // 3
    assert any(s.ulysses > 1 and s.ring > 1 for s in seen)
    assert any(s.ring > 1 and s.layout == "contiguous" for s in seen)
    assert any(len(s.docs) > 1 for s in seen)


# The document mask of the ring's steps off the own block, dropped as rings are written: xorl's
# sections (zigzag), and a plain whole-block ring in either layout, forward and backward alone.
# (variant, layout) -> the cause the report must name.
DOCMASK_CAUSE = "with the document mask applied only on the ring's own (diagonal) block"
WHOLE_ZIGZAG = "zigzag ring attention over whole blocks"
DOCMASK_CASES = {
    ("docmask_off_diagonal", "zigzag"): "zigzag ring attention " + DOCMASK_CAUSE,
    ("whole_blocks_docmask_off_diagonal", "zigzag"): WHOLE_ZIGZAG,
    ("whole_blocks_docmask_off_diagonal", "contiguous"): "ring attention " + DOCMASK_CAUSE,
    ("whole_blocks_docmask_off_diagonal_backward", "zigzag"):
        "the backward alone (its forward right) of " + WHOLE_ZIGZAG,
    ("whole_blocks_docmask_off_diagonal_backward", "contiguous"):
        "the backward alone (its forward right) of ring attention " + DOCMASK_CAUSE,
}


@pytest.mark.parametrize("layout", ["zigzag", "contiguous"])
def test_whole_block_ring_passes(layout):
    stats = {}
    spt.check(os.path.join(HERE, "broken_attention.py") + ":make('whole_blocks')", max_world=4,
              supports=dict(OPTIONS, layouts=(layout,)), max_examples=40, seed=5, stats=stats)
    assert stats["failures"] == 0 and stats["examples"] >= 36, stats


@pytest.mark.parametrize("variant,layout", sorted(DOCMASK_CASES))
def test_document_mask_off_the_own_block_named(variant, layout):
    ref = os.path.join(HERE, "broken_attention.py") + ":make(%r)" % variant
    report = _fail(ref, supports={"layouts": (layout,)}, max_examples=150)
    assert DOCMASK_CASES[variant, layout] in report, report
    assert not _children()


# The ring's schedule mistakes named under a gpt-oss-like layer (a window, sinks, capping) as
# under a causal one: one fixed scenario, so that the options cannot shrink away.
GPT_OSS_RING = dict(causal=True, chunk=0, docs=[32, 32], dtype="f32", head_dim=8, heads=4,
                    kv_heads=2, layout="zigzag", profile="xorl", q_scale=1.0, ring=4, seed=0,
                    sinks=True, softcap=20.0, ulysses=1, window_ahead=-1, window_back=5)
SCHEDULE_CASES = {
    "ring_src_off_by_one": "the ring source is off by one",
    "zigzag_swapped": "each local document as [late chunk | early chunk]",
    "local_cu": "cu_seqlens computed from each rank's local position ids",
    "docmask_off_diagonal": "zigzag ring attention " + DOCMASK_CAUSE,
    "whole_blocks_docmask_off_diagonal_backward":
        "the backward alone (its forward right) of " + WHOLE_ZIGZAG,
}


@pytest.mark.parametrize("variant", sorted(SCHEDULE_CASES))
def test_ring_schedule_mistakes_named_under_options(variant):
    ref = os.path.join(HERE, "broken_attention.py") + ":make(%r)" % variant
    ok, report = spt.run_one(ref, json.dumps(GPT_OSS_RING))
    assert not ok and SCHEDULE_CASES[variant] in report, report
    assert not _children()


@pytest.mark.parametrize("variant", sorted(OPTION_CASES))
def test_attention_option_mistake_found_and_shrunk(variant):
    supports, causes = OPTION_CASES[variant]
    ref = os.path.join(HERE, "broken_attention.py") + ":make(%r)" % variant
    report = _fail(ref, supports=supports, max_examples=150)
    assert any(c in report for c in causes), report
    scn = _scenario_of(report)
    assert scn.world <= 4 and scn.tokens <= 32, scn
    assert not _children()


def test_the_largest_examples_cause_goes_with_the_shrunk_one():
    """Shrunk to 2 tokens, a window one key too wide is the same numbers as no window at all:
    the report keeps the largest failing example's cause, which tells them apart."""
    ref = os.path.join(HERE, "broken_attention.py") + ":make('window_off_by_one')"
    report = _fail(ref, supports=dict(ZIGZAG, window=True), max_examples=150)
    assert "before shrinking, on the largest failing example" in report, report
    head, tail = report.split("before shrinking", 1)
    assert "it equals a sliding window one key too wide" in tail, report
    # the shrunk example's diagnosis says that both fit it, and the largest one which to take
    assert "1 other member reproduces these rows too: a sliding window one key too wide" in \
        head, report
    assert "the shrunk example fits it too" in tail, report


@pytest.mark.parametrize("variant", sorted(EXPECTED))
def test_broken_variant_found_and_shrunk(variant):
    ref = os.path.join(HERE, "broken_attention.py") + ":make(%r)" % variant
    report = _fail(ref)
    head = report.strip().splitlines()[0]
    want = EXPECTED[variant]
    if want == "raised":
        assert " raised " in head, report
    else:
        wants = want if isinstance(want, tuple) else (want,)
        assert any(": %s differs on" % w in head for w in wants), report
    assert CAUSE.get(variant, "") in report, report
    scn = _scenario_of(report)
    assert scn.world <= 4 and scn.tokens <= 32, scn
    assert not _children()


def test_rerun_command_reproduces_the_shrunk_case(tmp_path):
    ref = os.path.join(HERE, "broken_attention.py") + ":make('no_scale')"
    report = _fail(ref)
    line = next(l for l in report.splitlines() if l.strip().startswith("re-run:"))
    cmd = line.split("re-run:", 1)[1].strip()
    p = subprocess.run(["bash", "-c", cmd], capture_output=True, text=True, timeout=120)
    assert p.returncode == 1, p.stdout + p.stderr
    assert "lse differs on" in p.stdout and "scores not multiplied by the scale" in p.stdout, p.stdout
    # The kept dump is the shrunk example's and seqpar validate reads it on its own.
    dump = next(l for l in report.splitlines() if l.strip().startswith("dump:")).split()[1]
    v = subprocess.run([os.environ["SEQPAR"], "validate", "--dump", dump, "-q"],
                       capture_output=True, text=True)
    assert v.returncode == 1, v.stdout + v.stderr


def test_supports_skips_what_is_declared_unsupported(capsys):
    # The zigzag-only example is wrong on the contiguous ring layout: drawn, it fails ...
    report = _fail(EXAMPLE + ":attention", supports={})
    assert "contiguous" in _scenario_of(report).layout
    # ... declared, it is never drawn: by supports= ...
    stats = {}
    spt.check(EXAMPLE + ":attention", max_world=3, supports=ZIGZAG, max_examples=60, seed=2,
              stats=stats)
    assert stats["failures"] == 0
    # ... or by the module's SUPPORTS, read where supports= is not given (and said so).
    stats = {}
    spt.check(EXAMPLE + ":attention", max_world=3, max_examples=60, seed=2, stats=stats,
              progress=60)
    assert stats["failures"] == 0
    assert 'supports {"layouts": ["zigzag"]}, as the module of' in capsys.readouterr().err


def test_invalid_module_supports_is_named_at_its_source(tmp_path):
    # A module whose SUPPORTS misspells a key: the error names the file that declares it, before
    # any example runs; supports= overrides the module's declaration.
    mod = tmp_path / "misspelt_supports.py"
    mod.write_text("import sys\nsys.path.insert(0, %r)\n"
                   "import zigzag_ring_attention\n"
                   "SUPPORTS = {'layout': ['zigzag']}\n"
                   "def attention(*args, **kwargs):\n"
                   "    return zigzag_ring_attention.attention(*args, **kwargs)\n"
                   % os.path.dirname(EXAMPLE))
    with pytest.raises(ValueError) as e:
        spt.check(str(mod) + ":attention", max_world=2, max_examples=2)
    assert str(mod) in str(e.value) and "unknown keys ['layout']" in str(e.value), e.value
    assert not _children()
    stats = {}
    spt.check(str(mod) + ":attention", max_world=2, max_examples=3, seed=1,
              supports={"layouts": ["zigzag"]}, stats=stats)
    assert stats["failures"] == 0


# Bad user code fails on every example and every failing example restarts the pool (its
# collectives may be out of step): shrinking it would take minutes and prove nothing more about
# the words of the report, so these tests stop at the first failing example.
NO_SHRINK = {"phases": [hypothesis.Phase.explicit, hypothesis.Phase.reuse,
                        hypothesis.Phase.generate]}


def test_raising_rank_is_named_and_the_pool_recovers():
    report = _fail(bad_code.raises_on_rank1, max_examples=20, settings=NO_SHRINK)
    assert "rank 1 raised ValueError in forward" in report, report
    assert "rank 1 gives up" in report
    assert "waiting in torch.distributed" in report, report  # rank 0, stuck in its all-to-all
    assert not _children()


def test_hang_names_the_rank_that_did_not_return():
    scn = Scenario(ulysses=2, ring=2, layout="zigzag", heads=4, kv_heads=2, head_dim=4,
                   docs=(8,), dtype="f32")
    ok, text = spt.run_one(bad_code.hangs_on_rank0, scn, deadline=8)
    assert not ok
    first = text.splitlines()[0]
    assert "rank 0 did not return within 8 s (hang); the others waited for it" in first, text
    assert "busy at" in text and "bad_code.py" in text, text
    assert "waiting in torch.distributed" in text, text
    assert not _children()


def test_grace_after_a_raise_not_the_hang_deadline():
    # Rank 1 raises; the other ranks block in their collectives and never return. Once one rank
    # has failed, the others get a short grace (2 s), not the whole deadline (30 s here), before
    # the example is judged and the pool restarted.
    import time
    scn = Scenario(ulysses=2, ring=2, layout="zigzag", heads=4, kv_heads=2, head_dim=4,
                   docs=(8,), dtype="f32")
    spt.run_one(bad_code.healthy, scn, deadline=30)  # the pool is up: time the example alone
    t0 = time.monotonic()
    ok, text = spt.run_one(bad_code.raises_on_rank1, scn, deadline=30)
    took = time.monotonic() - t0
    assert not ok
    assert "rank 1 raised ValueError" in text, text
    assert took < 12, "the example took %.1f s: the others waited the deadline, not the grace" % took
    assert not _children()


@pytest.mark.parametrize("impl,words", [
    (bad_code.wrong_shape, "the rank's output must have q's shape"),
    (bad_code.wrong_dtype, "the output must have q's dtype"),
    (bad_code.returns_tuple, "the contract is attention(q, k, v, ctx) -> out"),
    (bad_code.writes_into_q, "wrote into its input q"),
    (bad_code.detached, "no gradient reached q"),
])
def test_contract_violations_are_named(impl, words):
    report = _fail(impl, max_examples=20, settings=NO_SHRINK)
    assert words in report, report
    assert not _children()


def test_cli_check_and_exit_codes(tmp_path):
    env = dict(os.environ, PYTHONPATH=os.path.join(ROOT, "python"))
    run = lambda *a: subprocess.run([sys.executable, "-m", "seqpar.testing"] + list(a),
                                    capture_output=True, text=True, env=env, timeout=300)
    p = run("check", EXAMPLE + ":attention", "--examples", "20", "--seed", "3", "--supports",
            '{"layouts": ["zigzag"]}', "--progress", "0")
    assert p.returncode == 0 and "PASS: 20 examples consistent" in p.stdout, p.stdout + p.stderr
    p = run("check", EXAMPLE + ":nonexistent")
    assert p.returncode != 0
    p = run("run", EXAMPLE + ":attention", "--scenario", '{"ulysses": 3}')
    assert p.returncode == 2 and "seqpar.testing: error:" in p.stderr, p.stderr
    p = run("run", EXAMPLE + ":attention", "--scenario", json.dumps(dict(
        ulysses=4, ring=1, layout="zigzag", heads=6, kv_heads=2, head_dim=4, docs=[5],
        dtype="f32")))
    assert p.returncode == 2 and "heads" in p.stderr, p.stderr


def test_dtypes_and_odd_shapes_of_the_healthy_example():
    for scn in (
        Scenario(3, 1, "zigzag", 6, 1, 7, (1, 4, 2), "bf16", seed=4),
        Scenario(1, 3, "zigzag", 2, 2, 3, (6, 12), "f16", seed=5),
        Scenario(2, 2, "zigzag", 8, 2, 5, (4, 12), "bf16", seed=6, q_scale=16.0),
        Scenario(2, 2, "zigzag", 4, 4, 16, (8,), "f32", seed=7, q_scale=64.0),
        # the KV repeat's three gradient copies nearly cancel at token 3 (their sum 0.234, each
        # copy larger): its f32 rounding is the copies', ~36 ulps of the sum, and is judged by
        # their magnitudes (the wheel's random draw found it, judged by the sum's value)
        Scenario(3, 1, "zigzag", 6, 1, 2, (14,), "f32", seed=15, q_scale=16.0,
                 profile="xorl"),
    ):
        ok, text = spt.run_one(EXAMPLE + ":attention", scn)
        assert ok, text


@pytest.mark.parametrize("supports", [ZIGZAG, dict(ring=False, profiles=("xorl",))])
def test_several_repeated_kv_heads_are_drawn_early(supports):
    """The one case where KV heads repeated blockwise differ from interleaved (a rank holding
    several KV heads, each repeated: 1 < Hkv < U) is weighted in the draw: it comes within the
    first 20 examples at every seed (drawn uniformly it came first at example 156 of seed 0;
    the healthy run's 100 examples rely on it: docs/development.md, "Test budgets")."""
    from hypothesis import HealthCheck, Phase, given, settings
    from hypothesis import seed as hseed
    from seqpar.testing.scenario import scenarios
    for s in range(5):
        seen = []

        @hseed(s)
        @settings(max_examples=20, phases=[Phase.generate], database=None, deadline=None,
                  suppress_health_check=list(HealthCheck))
        @given(scenarios(max_world=4, supports=supports))
        def draw(scn):
            seen.append(1 < scn.kv_heads < scn.ulysses)

        draw()
        assert any(seen), (s, len(seen))

"""seqpar.testing.check_step: the whole SP training step under the property, on real torch code
with gloo CPU ranks (python/examples/sp_training_step.py): the correct step passes, each classic
step mistake fails and is named in words a user recognises, bad user code (a step that raises,
hangs, returns no loss; a model factory that does not give every rank the same weights) is
reported, invalid input exits 2."""
import os
import subprocess
import sys

import pytest

HERE = os.path.dirname(os.path.abspath(__file__))
SRC = os.path.dirname(os.path.dirname(HERE))
sys.path.insert(0, os.path.join(SRC, "python"))
EXAMPLE = os.path.join(SRC, "python", "examples", "sp_training_step.py")
sys.path.insert(0, os.path.dirname(EXAMPLE))

import seqpar.testing as spt  # noqa: E402
import sp_training_step as ex  # noqa: E402
import torch.distributed as dist  # noqa: E402
from seqpar.testing.step import StepScenario  # noqa: E402

MODEL = EXAMPLE + ":TinyLM"


def step_ref(bug=None):
    return EXAMPLE + (":make_step()" if bug is None else ":make_step(%r)" % bug)


def test_correct_step_passes_f64_and_f32():
    stats = {}
    # 20 examples: every planted step mistake fails by its 5th example at seeds 0–2
    # (bench/budgets.py; bench/results/2026-11-29/budgets.txt).
    spt.check_step(step_ref(), MODEL, seed=0, max_examples=20, dtypes=("f64", "f32"),
                   stats=stats)
    assert stats["examples"] == 20 and stats["failures"] == 0


# Each mistake: the phrase its report must hold (on the shrunk example or, where shrinking
# leaves too little to tell, on the largest failing example kept beside it).
MISTAKES = {
    "shift_after_shard": "the logged loss is exactly the labels shifted after sharding",
    "local_denominator": "the denominator local where the numerator is global",
    "dp_group_only": "the gradient is not reduced over the SP group",
    "mean_of_means": "the mean of the DP replicas' means",
    "local_positions": "the forward under SP",
    "shift_twice": "the logged loss is exactly the labels shifted twice",
    "count_padding": "the logged loss is exactly the summed token losses divided by the "
                     "batch's tokens",
}


@pytest.mark.parametrize("bug", sorted(MISTAKES))
def test_each_mistake_is_found_and_named(bug):
    stats = {}
    with pytest.raises(spt.SpStepFailure) as e:
        spt.check_step(step_ref(bug), MODEL, seed=0, max_examples=60, stats=stats)
    text = str(e.value)
    assert MISTAKES[bug] in text, text
    assert "re-run:" in text and "run-step" in text
    # Found by the 4th example and shrunk in 11-28 runs in all (seed 0); Hypothesis's explain
    # phase, which reruns the shrunk example part by part for a note the report does not show,
    # would add ~100 (check_step leaves it out).
    assert stats["examples"] <= 45, stats


def test_loss_weights_correct_step_passes():
    # per-token loss weights (ms-swift's loss_scale): shifted and sharded with the labels
    stats = {}
    spt.check_step(step_ref(), MODEL, seed=0, max_examples=20, dtypes=("f64", "f32"),
                   loss_weights=True, stats=stats)
    assert stats["examples"] == 20 and stats["failures"] == 0


@pytest.mark.parametrize("bug,phrase", [
    ("weights_unshifted", "the per-token loss weights not shifted with the labels"),
    ("weights_unsharded", "the per-token loss weights not sharded with the labels"),
    ("shift_after_shard", "the labels shifted after sharding")])
def test_loss_weight_mistakes_are_found_and_named(bug, phrase):
    with pytest.raises(spt.SpStepFailure) as e:
        spt.check_step(step_ref(bug), MODEL, seed=0, max_examples=60, loss_weights=True)
    text = str(e.value)
    assert phrase in text, text
    assert '"weights":true' in text   # the re-run command draws them too


@pytest.mark.parametrize("bug,model,phrase", [
    ("local_positions", "qwen3", "the forward departs first at layer 0's attention output"),
    ("local_positions", "tiny", "the forward departs first at layer 0's output"),
    ("local_denominator", "qwen3", "the forward agrees at every layer"),
    ("dp_group_only", "tiny", "the forward agrees at every layer")])
def test_where_the_forward_departs_is_named(bug, model, phrase):
    # each layer's hidden states summed over the tokens, every rank's shards against the
    # reference's documents: RoPE from local positions departs in the first attention, a
    # denominator or a reduction leaves the forward intact
    scn = StepScenario(dp=1, ulysses=2, ring=1, rows=[[[[[9, 1]], [[3, 2]]]]], seed=1)
    if model == "qwen3":
        ok, text = spt.run_step(EXAMPLE + ":make_step(%r, hf=True)" % bug,
                                os.path.join(CONFIGS, "qwen3-8b.json"), scn, deadline=120)
    else:
        ok, text = spt.run_step(step_ref(bug), MODEL, scn, deadline=120)
    assert not ok
    assert phrase in text, text


def test_a_wrong_loss_with_the_forward_intact_is_not_blamed_on_the_forward():
    # 1.5 × the right loss: no searched mistake, and no coincidence of a count ratio with a
    # degree (1.5 = 2 × 9 labels / 12 tokens here) is named; the forward agrees, so the report
    # points at the loss computed from it
    import sp_training_step
    inner = sp_training_step.make_step()

    def odd_step(model, batches, ctx):
        return 1.5 * float(inner(model, batches, ctx))
    scn = StepScenario(dp=1, ulysses=2, ring=1, rows=[[[[[9, 1]], [[3, 2]]]]], seed=1)
    ok, text = spt.run_step(odd_step, MODEL, scn, deadline=120)
    assert not ok
    assert "and the forward agrees at every layer: the loss computed from it differs" in text, \
        text
    assert "the logged loss is exactly" not in text, text


def test_the_rerun_command_reproduces_the_failure():
    scn = StepScenario(dp=1, ulysses=2, ring=1, rows=[[[[[5, 1], [4, 0]]]]], seed=1)
    p = subprocess.run([sys.executable, "-m", "seqpar.testing", "run-step",
                        step_ref("local_denominator"), "--model", MODEL, "--scenario",
                        scn.to_json()], capture_output=True, text=True,
                       env=dict(os.environ, PYTHONPATH=os.path.join(SRC, "python")))
    assert p.returncode == 1, p.stdout + p.stderr
    assert "the denominator local where the numerator is global" in p.stdout, p.stdout
    p = subprocess.run([sys.executable, "-m", "seqpar.testing", "run-step", step_ref(),
                        "--model", MODEL, "--scenario", scn.to_json()], capture_output=True,
                       text=True, env=dict(os.environ, PYTHONPATH=os.path.join(SRC, "python")))
    assert p.returncode == 0 and "consistent" in p.stdout, p.stdout + p.stderr


def test_every_group_and_layout_and_accumulation_is_drawn():
    """The draw covers what check_step promises: DP > 1 with unequal valid labels, U and R > 1,
    both layouts, 2 micro-batches, 1-token and all-masked documents, padded rows, lengths that
    need SP padding."""
    from hypothesis import HealthCheck, given, settings
    from seqpar.testing.step import batches_of, shift_labels
    seen = set()

    @settings(max_examples=300, database=None, deadline=None,
              suppress_health_check=list(HealthCheck))
    @given(spt.step_scenarios(max_world=4))
    def draw(scn):
        seen.add(("dp", scn.dp > 1))
        seen.add(("ulysses", scn.ulysses > 1))
        seen.add(("ring", scn.ring > 1))
        seen.add(("layout", scn.layout))
        seen.add(("accumulation", scn.accumulation))
        docs = [x for mbs in scn.rows for mb in mbs for r in mb for x in r]
        seen.add(("1-token doc", any(x[0] == 1 for x in docs)))
        seen.add(("all-masked doc", any(x[0] > 1 and x[1] >= x[0] for x in docs)))
        lens = [sum(x[0] for x in r) for mbs in scn.rows for mb in mbs for r in mb]
        seen.add(("sp padding", any(L % (2 * scn.sp) for L in lens) and scn.sp > 1))
        seen.add(("row padding", any(len({sum(x[0] for x in r) for r in mb}) > 1
                                     for mbs in scn.rows for mb in mbs)))
        if scn.dp > 1:
            counts = [sum(int((shift_labels(b["labels"]) != -100).sum()) for b in mbs)
                      for mbs in batches_of(scn, 40)]
            seen.add(("unequal dp", len(set(counts)) > 1))
    draw()
    want = {("dp", True), ("ulysses", True), ("ring", True), ("layout", "zigzag"),
            ("layout", "contiguous"), ("accumulation", 2), ("1-token doc", True),
            ("all-masked doc", True), ("sp padding", True), ("row padding", True),
            ("unequal dp", True)}
    assert want <= seen, sorted(want - seen)


def test_narrowed_draws_keep_within_and_cover_their_bounds():
    """max_dp, max_ring and ulysses_degrees (a trainer without DP or ring, Ulysses degrees that
    divide the heads) bound every drawn layout and still draw each degree they allow: a bound
    that drew nothing, or only world 1, would make a passing property vacuous."""
    from hypothesis import HealthCheck, given, settings
    seen = set()

    @settings(max_examples=150, database=None, deadline=None,
              suppress_health_check=list(HealthCheck))
    @given(spt.step_scenarios(max_world=4, max_dp=1, max_ring=1, ulysses_degrees=(2, 4),
                              accumulation=False))
    def draw(scn):
        assert scn.dp == 1 and scn.ring == 1 and scn.ulysses in (2, 4), scn.describe()
        assert scn.accumulation == 1, scn.describe()
        seen.add(scn.ulysses)
    draw()
    assert seen == {2, 4}, seen
    with pytest.raises(ValueError, match="no DP × Ulysses × ring layout"):
        spt.step_scenarios(max_world=4, ulysses_degrees=(8,))   # 8 ranks exceed the world


def raising_step(model, batches, ctx):
    if ctx.rank == 1:
        raise RuntimeError("labels and logits disagree: 7 vs 8")
    return 0.0


def hanging_step(model, batches, ctx):
    import torch
    t = torch.zeros(1)
    if ctx.rank != 0:  # rank 0 skips the collective the others wait in
        dist.all_reduce(t)
    return 0.0


def list_step(model, batches, ctx):
    return [1.0, 2.0]


def drifting_model():
    m = ex.TinyLM()
    if dist.is_initialized() and dist.get_rank() == 1:  # rank 1 builds other weights
        import torch
        with torch.no_grad():
            m.head.weight.add_(1.0)
    return m


def test_bad_user_code_is_reported():
    scn = StepScenario(dp=1, ulysses=2, ring=1, rows=[[[[[5, 1]]]]], seed=1).to_json()
    ok, text = spt.run_step(raising_step, ex.TinyLM, scn)
    assert not ok and "rank 1 raised RuntimeError in the step" in text, text
    assert "labels and logits disagree" in text and "raising_step" in text, text
    ok, text = spt.run_step(hanging_step, ex.TinyLM, scn, deadline=5)
    assert not ok and "did not return within 5 s (hang)" in text, text
    assert "all_reduce" in text, text
    ok, text = spt.run_step(list_step, ex.TinyLM, scn)
    assert not ok and "it must return the loss the trainer logs" in text, text


def test_a_model_factory_with_other_weights_per_rank_is_named():
    scn = StepScenario(dp=1, ulysses=2, ring=1, rows=[[[[[5, 1]]]]], seed=1).to_json()
    ok, text = spt.run_step(ex.make_step(), drifting_model, scn)
    assert not ok and "other weights than the reference's copy" in text, text


def test_invalid_input_exits_2():
    env = dict(os.environ, PYTHONPATH=os.path.join(SRC, "python"))
    for scn in ('{"dp":0}', '{"dp":1,"rows":[[[[]]]]}', '{"dpp":1}', 'not json'):
        p = subprocess.run([sys.executable, "-m", "seqpar.testing", "run-step", step_ref(),
                            "--model", MODEL, "--scenario", scn], capture_output=True,
                           text=True, env=env)
        assert p.returncode == 2, (scn, p.stdout, p.stderr)
        assert "seqpar.testing: error:" in p.stderr and "Traceback" not in p.stderr, p.stderr
    p = subprocess.run([sys.executable, "-m", "seqpar.testing", "check-step", step_ref(),
                        "--model", EXAMPLE + ":NoSuchModel"], capture_output=True, text=True,
                       env=env)
    assert p.returncode == 2 and "NoSuchModel" in p.stderr, p.stderr
    for flag, words in (("x,2", "--ulysses 'x,2'"), ("8", "no DP × Ulysses × ring layout")):
        p = subprocess.run([sys.executable, "-m", "seqpar.testing", "check-step", step_ref(),
                            "--model", MODEL, "--ulysses", flag], capture_output=True,
                           text=True, env=env)
        assert p.returncode == 2 and words in p.stderr and "Traceback" not in p.stderr, \
            (flag, p.stderr)


# -- models of real architectures, from their configs (transformers 5.9, drawn down) ---------

CONFIGS = os.path.join(HERE, "data", "hf_configs")


@pytest.mark.parametrize("name", ["qwen3-8b", "gpt-oss-20b", "gemma3-4b", "llama4-scout"])
def test_hf_models_under_the_whole_step_property(name):
    """The example's SP path (sp_gather_attention registered with transformers) on small models
    of each architecture: GQA, sliding windows (gpt-oss, Gemma 3), sinks (gpt-oss), chunked
    and NoPE layers (Llama 4), mixtures of experts, tied embeddings (Gemma 3)."""
    stats = {}
    spt.check_step(EXAMPLE + ":make_step(hf=True)", os.path.join(CONFIGS, name + ".json"),
                   seed=0, max_examples=12, stats=stats)
    assert stats["failures"] == 0 and stats["examples"] == 12


@pytest.mark.parametrize("bug", ["shift_after_shard", "local_denominator", "dp_group_only"])
def test_the_three_classic_mistakes_in_a_qwen3_step(bug):
    with pytest.raises(spt.SpStepFailure) as e:
        spt.check_step(EXAMPLE + ":make_step(%r, hf=True)" % bug,
                       os.path.join(CONFIGS, "qwen3-8b.json"), seed=0, max_examples=40)
    assert MISTAKES[bug] in str(e.value), str(e.value)
    assert "--hf-config" in str(e.value)


def test_configs_are_drawn_down_keeping_what_matters_to_sp():
    from seqpar.testing.hf import scale_down
    small, notes = scale_down(os.path.join(CONFIGS, "gpt-oss-20b.json"))
    assert small.model_type == "gpt_oss"
    assert small.num_attention_heads // small.num_key_value_heads == 8  # GQA ratio kept
    assert small.layer_types == ["sliding_attention", "full_attention"]
    assert small.sliding_window == 4 and small.head_dim % 2 == 0 and small.vocab_size == 64
    small, _ = scale_down(os.path.join(CONFIGS, "llama4-scout.json"))
    assert small.layer_types == ["chunked_attention", "full_attention"]
    assert small.no_rope_layers == [1, 0] and small.attention_chunk_size == 4
    assert small.num_attention_heads // small.num_key_value_heads == 5
    small, _ = scale_down(os.path.join(CONFIGS, "gemma3-4b.json"))
    assert small.tie_word_embeddings and small.layer_types == ["sliding_attention",
                                                                "full_attention"]


def test_a_config_seqpar_cannot_build_is_refused(tmp_path):
    env = dict(os.environ, PYTHONPATH=os.path.join(SRC, "python"))
    bad = tmp_path / "config.json"
    for text, want in (('{"hidden_size": 8}', "no model_type"),
                       ('{"model_type": "no_such_arch"}', "no_such_arch"),
                       ('{"model_type": "qwen3", "num_attention_heads": 6, '
                        '"num_key_value_heads": 4}', "not a multiple of"),
                       ("{", "not JSON")):
        bad.write_text(text)
        p = subprocess.run([sys.executable, "-m", "seqpar.testing", "check-step",
                            step_ref(), "--hf-config", str(bad)], capture_output=True,
                           text=True, env=env)
        assert p.returncode == 2 and want in p.stderr, (text, p.stderr[-800:])
        assert "Traceback" not in p.stderr

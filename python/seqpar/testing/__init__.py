"""Property tests of your own sequence-parallel attention.

You write one function per rank::

    def attention(q, k, v, ctx):      # q [s_local, H, D], k/v [s_local, Hkv, D]
        ...                           # your Ulysses / ring / hybrid attention, with ctx's groups
        return out                    # [s_local, H, D], q's dtype, differentiable

and seqpar.testing draws scenarios with Hypothesis (world ≤ max_world, every ulysses × ring
factorisation, zigzag or contiguous, GQA with fewer KV heads than the Ulysses degree, odd
head_dim, 1-token and padded documents, f32/bf16/f16, data seeds), lays each out with seqpar's
own core, runs your function forward and backward on U·R gloo CPU ranks (a persistent pool),
dumps every rank through the hook and judges the dump with ``seqpar validate --dump``. A failure
is shrunk to the smallest scenario that still fails and reported with seqpar's diagnosis, the
kept dump and a command that re-runs exactly that case::

    import seqpar.testing as spt

    def test_my_attention():
        spt.check(attention, max_world=4, supports=dict(layouts=("zigzag",)))

    test_it = spt.property_test(attention, max_world=4)     # or: a ready-made pytest test

A whole training step goes under the same kind of property with ``check_step``: your model
(a factory) and your step (shard the batch, forward through your SP path, loss, backward,
gradient reduction: ``step(model, batches, ctx) -> loss``) on DP × SP ranks, judged against the
same model without SP in float64 (see ``seqpar.testing.step``)::

    spt.check_step(my_step, model=make_model, max_world=4)

See ``AttentionContext`` for ctx, ``Supports`` for declaring what an implementation does not
support (not drawn, so skipped rather than failed), and ``python3 -m seqpar.testing --help``.
"""
from .context import AttentionContext  # noqa: F401
from .scenario import Scenario, Supports, scenarios  # noqa: F401

from .step import StepContext, StepScenario, step_scenarios  # noqa: F401,E402

__all__ = ["check", "property_test", "run_one", "AttentionContext", "Scenario", "Supports",
           "scenarios", "SpAttentionFailure", "check_step", "run_step", "step_property_test",
           "StepContext", "StepScenario", "step_scenarios", "SpStepFailure"]


class SpAttentionFailure(AssertionError):
    """An example on which the implementation is not consistent with seqpar's reference."""


class SpStepFailure(AssertionError):
    """An example on which the training step is not consistent with the step without SP."""


def _make_runner(impl, seqpar, deadline, start_method, impl_ref, keep, name):
    from .runner import Runner
    return Runner(impl, seqpar=seqpar, deadline=deadline, start_method=start_method,
                  impl_ref=impl_ref, keep_root=keep, name=name)


def run_one(impl, scenario, *, seqpar=None, deadline=30.0, start_method="fork", impl_ref=None,
            keep=None):
    """Runs one scenario (a Scenario or its JSON) and returns (ok, report text). keep: a
    directory that keeps the case's dump, consistent or not (example-000001/)."""
    scn = scenario if isinstance(scenario, Scenario) else Scenario.from_json(scenario)
    runner = _make_runner(impl, seqpar, deadline, start_method, impl_ref, keep, None)
    runner.keep_passing = keep is not None
    try:
        out = runner.run(scn)
        if out.kind == "refused":
            raise ValueError(out.summary)
        text = runner.report(scn, out) if not out.ok else "%s: consistent on %s" % (
            runner.name, scn.describe())
        return out.ok, text
    finally:
        runner.close()


def check(impl, *, max_world=4, supports=None, max_examples=100, max_tokens=64, seed=None,
          deadline=30.0, seqpar=None, start_method="fork", impl_ref=None, keep=None, name=None,
          progress=None, settings=None, stats=None):
    """Runs the property: for every drawn scenario, `impl` on U·R gloo ranks must be consistent
    with seqpar's float64 reference, forward and backward. Raises SpAttentionFailure with the
    report of the smallest failing scenario Hypothesis finds.

    impl: the per-rank function `attention(q, k, v, ctx) -> out`, or a reference
      "file.py:NAME" / "module:NAME" (NAME may be a call such as make(bug='x')).
    supports: a dict or Supports: what is not supported is not drawn. None: the SUPPORTS that
      the implementation's module declares at its top level, if it declares one, else
      everything ({} draws everything whatever the module declares).
    seed: a fixed Hypothesis seed (reproducible runs, e.g. CI); None draws afresh each run.
    deadline: seconds one example may take on the ranks before it is reported as a hang.
    progress: print a progress line to stderr every that many seconds (None: silent).
    settings: extra hypothesis.settings keyword arguments.
    stats: a dict that receives examples run, failures, first_failure (how many examples had run
      when the first failure came: the budget a mistake like it needs; None without one) and
      seconds per phase.
    """
    import dataclasses
    import json
    import os
    import sys

    import hypothesis
    from hypothesis import given, reject

    from .impl_ref import declared_supports

    max_examples = int(os.environ.get("SEQPAR_TESTING_EXAMPLES") or max_examples)

    runner = _make_runner(impl, seqpar, deadline, start_method, impl_ref, keep, name)
    runner.progress = progress
    if supports is None:
        try:
            supports = declared_supports(runner.resolved)
        except ValueError:
            runner.close()
            raise
        if supports is not None and progress:
            shown = supports if isinstance(supports, dict) else dataclasses.asdict(supports)
            print("seqpar.testing: supports %s, as the module of %s declares (SUPPORTS); "
                  "supports= or --supports overrides it" % (json.dumps(shown), runner.name),
                  file=sys.stderr)
    strategy = scenarios(max_world=max_world, supports=supports, max_tokens=max_tokens)
    sup = Supports.of(supports)
    kw = _hypothesis_settings(max_examples, settings)

    largest = {}  # the largest failing example seen (Hypothesis shrinks from it)

    def prop(scn):
        out = runner.run(scn, sup)  # "refused" when outside supports (checked after layout)
        if out.kind == "refused":
            reject()
        if not out.ok:
            text = runner.report(scn, out)
            size = scn.tokens * scn.world
            if size > largest.get("size", -1):
                largest.update(size=size, text=text, tokens=scn.tokens)
            raise SpAttentionFailure("\n" + text)

    test = given(strategy)(hypothesis.settings(**kw)(prop))
    if seed is not None:
        test = hypothesis.seed(seed)(test)
    try:
        test()
    except SpAttentionFailure as e:
        # A shrunk example can make two mistakes the same numbers (a window of 1 key one too
        # wide is no window at all): where the largest failing example named another cause,
        # its diagnosis goes with the shrunk one, and the more specific cause is its.
        shrunk = str(e)
        cause = _named_cause(largest.get("text", ""))
        if cause and _cause_kind(cause) != _cause_kind(_named_cause(shrunk)):
            # listed among the shrunk example's other reproducing members (with the shrunk
            # example's own numbers), or not fitting it
            fits = ("the shrunk example fits it too, beside the one it leads with"
                    if _cause_kind(cause) in _cause_kind(shrunk)
                    else "the shrunk example cannot tell the two apart")
            raise SpAttentionFailure(
                shrunk + "\n  before shrinking, on the largest failing example (%d tokens), "
                "another cause fits its many more rows — %s; this is the one to look for "
                "first:\n%s"
                % (largest["tokens"], fits, "\n".join(
                    "    " + ln for ln in largest["text"].splitlines()[1:])))
        raise
    finally:
        if stats is not None:
            stats.update(examples=runner.count, failures=runner.failures,
                         first_failure=runner.first_failure,
                         seconds=dict(runner.seconds), wall=runner.elapsed(),
                         pool_starts=sum(p.starts for p in runner.pools.values()))
        runner.close()


def _hypothesis_settings(max_examples, settings):
    """The hypothesis.settings keywords of a property run, `settings` over them. No explain
    phase: after shrinking, Hypothesis reruns the shrunk example with each part varied to say
    which parts do not matter, in a note that seqpar's report does not show; on a step mistake
    that fails from the first example that was 100 of its 111 runs (29 s of 32)."""
    from hypothesis import HealthCheck, Phase
    kw = dict(max_examples=max_examples, deadline=None, print_blob=False,
              suppress_health_check=list(HealthCheck), database=None,
              phases=[p for p in Phase if p != Phase.explain])
    kw.update(settings or {})
    return kw


def _named_cause(report):
    """The cause a report's diagnosis names ("it equals X"), or ""."""
    import re
    m = re.search(r"it equals (.+?)(?: \(found among| \(stage |$)", report, re.M)
    return m.group(1) if m else ""


def _cause_kind(text):
    """A cause's words without its example's numbers: the innermost parenthesised asides go
    ("a sliding window one key too wide (13 keys back where the meta says 12)" on one example is
    the same cause as "(1 keys back where the meta says 0)" on another)."""
    import re
    return re.sub(r" \([^()]*\)", "", text)


def property_test(impl, **kw):
    """A zero-argument test function (for pytest) that runs check(impl, **kw)."""
    def test():
        check(impl, **kw)
    test.__name__ = "test_%s" % (kw.get("name") or getattr(impl, "__name__", "attention"))
    test.__doc__ = "seqpar.testing property of %s" % getattr(impl, "__name__", impl)
    return test


def run_step(step, model, scenario, *, deadline=60.0, start_method="fork", forward=None,
             attn="seqpar_reference"):
    """Runs one StepScenario (or its JSON) of `step` on `model`; returns (ok, report text)."""
    from .step import StepRunner
    scn = scenario if isinstance(scenario, StepScenario) else StepScenario.from_json(scenario)
    runner = StepRunner(step, model, deadline=deadline, start_method=start_method,
                        forward=forward, attn=attn)
    try:
        out = runner.run(scn)
        text = runner.report(scn, out) if not out.ok else "%s: consistent on %s" % (
            runner.name, scn.describe())
        return out.ok, text
    finally:
        runner.close()


def check_step(step, model, *, max_world=4, max_examples=30, max_tokens=24, dtypes=("f64",),
               accumulation=True, seed=None, deadline=60.0, start_method="fork", forward=None,
               name=None, progress=None, settings=None, stats=None, max_dp=None, max_ring=None,
               ulysses_degrees=None, attn="seqpar_reference", loss_weights=False):
    """Runs the whole-step property: for every drawn StepScenario, `step(model, batches, ctx)`
    on DP × SP gloo ranks must log the reference's loss and leave every parameter's gradient
    equal to the reference's on every rank (float64: ≤ 1e-10 relative). Raises SpStepFailure
    with the report of the smallest failing example Hypothesis finds.

    step: the per-rank step, or "file.py:NAME" / "module:NAME".
    model: a zero-argument factory of a torch.nn.Module (seqpar seeds torch's RNG before each
      call, so every rank and the reference get the same weights), or "file.py:NAME"; or a
      transformers config (a config.json path or its directory, a dict with "model_type", a
      PretrainedConfig): small models of its architecture (seqpar.testing.hf.hf_model).
    forward: how the reference calls the model on a whole micro-batch (default:
      model(input_ids=, position_ids=), its .logits when it has them).
    accumulation: draw 2 micro-batches per DP rank too (gradient accumulation).
    max_dp, max_ring: the largest DP and ring degrees drawn (1: a trainer without them).
    ulysses_degrees: the Ulysses degrees drawn (e.g. (1, 2, 4): those that divide the heads).
    loss_weights: every micro-batch carries per-token loss weights ("loss_weights" [B, L],
      float64, aligned with the labels: label t's weight); the loss the step must log is
      Σ weight · token loss over the valid shifted labels / their count (ms-swift's loss_scale).
    attn: the attention transformers runs in a model built from a config — "seqpar_reference"
      (transformers' mask, float64 softmax) or "seqpar_varlen" (flash_attention_2's contract:
      documents from position_ids, no mask tensor; what DeepSpeed's ALST wraps).
    """
    import os

    import hypothesis
    from hypothesis import given

    from .step import StepRunner
    max_examples = int(os.environ.get("SEQPAR_TESTING_EXAMPLES") or max_examples)
    runner = StepRunner(step, model, deadline=deadline, start_method=start_method, name=name,
                        forward=forward, attn=attn)
    runner.progress = progress
    strategy = step_scenarios(max_world=max_world, max_tokens=max_tokens, dtypes=dtypes,
                              accumulation=accumulation, max_dp=max_dp, max_ring=max_ring,
                              ulysses_degrees=ulysses_degrees, weights=loss_weights)
    kw = _hypothesis_settings(max_examples, settings)

    largest = {}  # the largest failing example seen (Hypothesis shrinks from it)

    def prop(scn):
        out = runner.run(scn)
        if not out.ok:
            text = runner.report(scn, out)
            size = sum(x[0] for mbs in scn.rows for mb in mbs for r in mb for x in r)
            if size > largest.get("size", -1):
                largest.update(size=size, text=text, details=out.details)
            raise SpStepFailure("\n" + text)

    test = given(strategy)(hypothesis.settings(**kw)(prop))
    if seed is not None:
        test = hypothesis.seed(seed)(test)
    try:
        test()
    except SpStepFailure as e:
        # The shrunk example can lose what names the mistake (a 2-token batch whose one label
        # is lost leaves nothing to divide): the largest failing example's diagnosis goes with
        # it when it names a cause the shrunk one does not.
        shrunk = str(e)
        named = [ln.strip() for ln in largest.get("details", "").splitlines()
                 if ln.strip().startswith(("the logged loss is exactly", "every rank's gradient",
                                           "the ranks of one"))]
        missing = [ln for ln in named if ln.split(" (")[0] not in shrunk]
        if missing:
            raise SpStepFailure(shrunk + "\n  before shrinking, on the largest failing example "
                                "(%d tokens):\n%s" % (largest["size"], "\n".join(
                                    "    " + ln for ln in largest["text"].splitlines()[1:])))
        raise
    finally:
        if stats is not None:
            stats.update(examples=runner.count, failures=runner.failures,
                         first_failure=runner.first_failure,
                         seconds=dict(runner.seconds), wall=runner.elapsed())
        runner.close()


def step_property_test(step, model, **kw):
    """A zero-argument test function (for pytest) that runs check_step(step, model, **kw)."""
    def test():
        check_step(step, model, **kw)
    test.__name__ = "test_%s" % (kw.get("name") or getattr(step, "__name__", "step"))
    return test

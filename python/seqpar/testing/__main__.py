"""python3 -m seqpar.testing: the property from the command line.

    python3 -m seqpar.testing run IMPL --scenario JSON     # exactly one case (the re-run command)
    python3 -m seqpar.testing check IMPL [--max-world 4] [--examples 100] [--supports JSON] …
    python3 -m seqpar.testing check-step STEP --model FACTORY [--max-world 4] [--examples 30] …
    python3 -m seqpar.testing run-step STEP --model FACTORY --scenario JSON

IMPL is FILE.py:NAME or MODULE:NAME (NAME may be a call, e.g. "impls.py:make('no_scale')");
so are STEP (your training step, step(model, batches, ctx) -> loss) and FACTORY (a zero-argument
function returning the model).
Exit codes: 0 consistent, 1 a failing example (its report printed), 2 invalid input.
"""
import argparse
import json
import sys


def main(argv=None):
    ap = argparse.ArgumentParser(prog="python3 -m seqpar.testing",
                                 description="property tests of your own SP attention",
                                 formatter_class=argparse.RawDescriptionHelpFormatter,
                                 epilog=__doc__)
    sub = ap.add_subparsers(dest="cmd", required=True)
    r = sub.add_parser("run", help="run one scenario (as printed by a failing property)")
    r.add_argument("impl")
    r.add_argument("--scenario", required=True, help="the scenario's JSON")
    c = sub.add_parser("check", help="run the property: draw, run, judge, shrink")
    c.add_argument("impl")
    c.add_argument("--max-world", type=int, default=4)
    c.add_argument("--examples", type=int, default=100)
    c.add_argument("--max-tokens", type=int, default=64)
    c.add_argument("--supports", default=None,
                   help='JSON, e.g. \'{"ring": false, "dtypes": ["f32"]}\' (default: the '
                   'SUPPORTS that the implementation\'s module declares, if any; {} draws '
                   'everything)')
    c.add_argument("--seed", type=int, default=None)
    c.add_argument("--progress", type=float, default=10.0,
                   help="seconds between progress lines (0: none)")
    cs = sub.add_parser("check-step", help="the whole-step property: your step on DP × SP "
                        "ranks against the model without SP, loss and every gradient")
    rs = sub.add_parser("run-step", help="run one step scenario (as printed by a failing "
                        "check-step)")
    for p in (cs, rs):
        p.add_argument("step")
        mg = p.add_mutually_exclusive_group(required=True)
        mg.add_argument("--model", help="FILE.py:NAME of the model factory")
        mg.add_argument("--hf-config", help="a transformers config.json (or its directory): "
                        "small models of its architecture")
        p.add_argument("--deadline", type=float, default=60.0,
                       help="seconds per example before it counts as a hang")
        p.add_argument("--attn", default="seqpar_reference",
                       choices=("seqpar_reference", "seqpar_varlen"),
                       help="with --hf-config: the attention transformers runs (seqpar_varlen: "
                       "flash_attention_2's contract, documents from position_ids)")
    rs.add_argument("--scenario", required=True, help="the step scenario's JSON")
    cs.add_argument("--max-world", type=int, default=4)
    cs.add_argument("--max-dp", type=int, default=None, help="largest DP degree drawn")
    cs.add_argument("--max-ring", type=int, default=None, help="largest ring degree drawn")
    cs.add_argument("--ulysses", default=None,
                    help="comma-separated Ulysses degrees drawn (e.g. 1,2,4: those that divide "
                    "the model's heads)")
    cs.add_argument("--examples", type=int, default=30)
    cs.add_argument("--max-tokens", type=int, default=24)
    cs.add_argument("--dtypes", default="f64", help="comma-separated: f64, f32")
    cs.add_argument("--no-accumulation", action="store_true",
                    help="one micro-batch per DP rank (no gradient accumulation drawn)")
    cs.add_argument("--loss-weights", action="store_true",
                    help="every micro-batch carries per-token loss weights (loss_weights, "
                    "aligned with the labels); the loss is Σ weight·token loss / valid labels")
    cs.add_argument("--seed", type=int, default=None)
    cs.add_argument("--progress", type=float, default=10.0,
                    help="seconds between progress lines (0: none)")
    for p in (r, c):
        p.add_argument("--seqpar", default=None, help="the seqpar binary (default: the one "
                       "installed with this package, $SEQPAR, PATH, the checkout's "
                       "build/tools/seqpar)")
        p.add_argument("--deadline", type=float, default=30.0,
                       help="seconds per example before it counts as a hang")
        p.add_argument("--keep", default=None,
                       help="directory for the failing example's dump (run: the case's dump, "
                       "consistent or not)")
        p.add_argument("--start-method", default="fork", choices=("fork", "spawn",
                                                                 "forkserver"))
    a = ap.parse_args(argv)

    from . import SpAttentionFailure, check, run_one
    from .scenario import SeqparNotFound
    if a.cmd in ("check-step", "run-step"):
        return _step_main(a)
    try:
        if a.cmd == "run":
            ok, text = run_one(a.impl, a.scenario, seqpar=a.seqpar, deadline=a.deadline,
                               start_method=a.start_method, keep=a.keep)
            print(text)
            return 0 if ok else 1
        supports = json.loads(a.supports) if a.supports else None
        stats = {}
        try:
            check(a.impl, max_world=a.max_world, supports=supports, max_examples=a.examples,
                  max_tokens=a.max_tokens, seed=a.seed, deadline=a.deadline, seqpar=a.seqpar,
                  start_method=a.start_method, keep=a.keep, progress=a.progress or None,
                  stats=stats)
        except SpAttentionFailure as e:
            print("FAIL after %d examples:%s" % (stats.get("examples", 0), e))
            if stats.get("first_failure"):
                print("(the first failing example was number %d: the budget this mistake "
                      "needed at this seed)" % stats["first_failure"])
            return 1
        print("PASS: %d examples consistent (%.1f s)" % (stats["examples"], stats["wall"]))
        return 0
    except (ValueError, TypeError, SeqparNotFound) as e:
        print("seqpar.testing: error: %s" % e, file=sys.stderr)
        return 2


def _step_main(a):
    from . import SpStepFailure, check_step, run_step
    model = a.model or a.hf_config
    try:
        if a.cmd == "run-step":
            ok, text = run_step(a.step, model, a.scenario, deadline=a.deadline, attn=a.attn)
            print(text)
            return 0 if ok else 1
        dtypes = tuple(x.strip() for x in a.dtypes.split(",") if x.strip())
        bad = [x for x in dtypes if x not in ("f64", "f32")]
        if bad or not dtypes:
            raise ValueError("--dtypes %r: give f64 and/or f32, comma-separated" % a.dtypes)
        try:
            uly = tuple(int(x) for x in a.ulysses.split(",")) if a.ulysses else None
        except ValueError:
            raise ValueError("--ulysses %r: give comma-separated degrees, e.g. 1,2,4" % a.ulysses)
        stats = {}
        try:
            check_step(a.step, model, max_world=a.max_world, max_examples=a.examples,
                       max_tokens=a.max_tokens, dtypes=dtypes,
                       accumulation=not a.no_accumulation, seed=a.seed, deadline=a.deadline,
                       progress=a.progress or None, stats=stats, max_dp=a.max_dp,
                       max_ring=a.max_ring, ulysses_degrees=uly, attn=a.attn,
                       loss_weights=a.loss_weights)
        except SpStepFailure as e:
            print("FAIL after %d examples:%s" % (stats.get("examples", 0), e))
            if stats.get("first_failure"):
                print("(the first failing example was number %d: the budget this mistake "
                      "needed at this seed)" % stats["first_failure"])
            return 1
        print("PASS: %d steps consistent (%.1f s; reference %.1f s, ranks %.1f s)" % (
            stats["examples"], stats["wall"], stats["seconds"]["reference"],
            stats["seconds"]["ranks"]))
        return 0
    except (ValueError, TypeError) as e:
        print("seqpar.testing: error: %s" % e, file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())

#!/usr/bin/env python3
"""seqpar.testing's throughput: examples per second of the property on the worked example
(python/examples/zigzag_ring_attention.py), at world 2 and 4, f32, rows of at most 256 tokens,
against the time of one `seqpar validate --dump` in the same run, and where the time goes
(layout = seqpar plan, ranks = the gloo pool runs forward + backward and dumps, validate).

    python3 bench/py_property_rate.py [--examples 200] [--json]      (SEQPAR=build/tools/seqpar)
"""
import argparse
import json
import os
import random
import sys
import time

ROOT = os.path.abspath(os.path.join(os.path.dirname(__file__), ".."))
sys.path.insert(0, os.path.join(ROOT, "python"))

from seqpar.testing.runner import Runner  # noqa: E402
from seqpar.testing.scenario import Scenario  # noqa: E402

EXAMPLE = os.path.join(ROOT, "python", "examples", "zigzag_ring_attention.py") + ":attention"


def scenarios(world, n, max_tokens, rnd):
    facts = [(world // r, r) for r in range(1, world + 1) if world % r == 0]
    out = []
    while len(out) < n:
        U, R = rnd.choice(facts)
        unit = 2 * R
        Hkv = rnd.choice([h for h in (1, 2, 4) if U % h == 0 or h % U == 0])
        rep = U // Hkv if U > Hkv else 1
        H = Hkv * rep * rnd.choice([1, 2])
        docs, left = [], rnd.randint(unit, max_tokens)
        while left >= unit and len(docs) < 4:
            c = rnd.randint(1, left // unit)
            docs.append(c * unit)
            left -= c * unit
        out.append(Scenario(U, R, "zigzag", H, Hkv, rnd.choice([4, 8, 16, 5]), tuple(docs), "f32",
                            seed=rnd.randint(0, 1 << 16)))
    return out


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--examples", type=int, default=200)
    ap.add_argument("--max-tokens", type=int, default=256)
    ap.add_argument("--json", action="store_true")
    a = ap.parse_args()
    rnd = random.Random(7)
    rows = []
    for world in (2, 4):
        scns = scenarios(world, a.examples, a.max_tokens, rnd)
        r = Runner(EXAMPLE)
        r.run(scns[0])  # the pool starts once; not timed
        r.seconds = dict.fromkeys(r.seconds, 0.0)
        t0 = time.perf_counter()
        bad = 0
        for s in scns:
            bad += not r.run(s).ok
        wall = time.perf_counter() - t0
        secs = dict(r.seconds)
        r.close()
        rows.append(dict(world=world, examples=len(scns), failing=bad, wall_s=wall,
                         examples_per_s=len(scns) / wall,
                         validate_ms_per_example=1e3 * secs["validate"] / len(scns),
                         ranks_ms_per_example=1e3 * secs["ranks"] / len(scns),
                         layout_ms_per_example=1e3 * secs["layout"] / len(scns),
                         mean_tokens=sum(s.tokens for s in scns) / len(scns)))
    if a.json:
        print(json.dumps({"rows": rows}, indent=1))
        return 0
    print("%-6s %9s %8s %12s %14s %12s %12s %8s" % ("world", "examples", "failing", "examples/s",
                                                    "ranks ms/ex", "validate ms", "layout ms",
                                                    "tokens"))
    for x in rows:
        print("%-6d %9d %8d %12.2f %14.1f %12.1f %12.2f %8.0f" % (
            x["world"], x["examples"], x["failing"], x["examples_per_s"],
            x["ranks_ms_per_example"], x["validate_ms_per_example"], x["layout_ms_per_example"],
            x["mean_tokens"]))
    for x in rows:
        print("world %d: one example = %.1f × the time of one seqpar validate --dump (%.1f ms)" % (
            x["world"], 1e3 / x["examples_per_s"] / x["validate_ms_per_example"],
            x["validate_ms_per_example"]))
    return 0


if __name__ == "__main__":
    sys.exit(main())

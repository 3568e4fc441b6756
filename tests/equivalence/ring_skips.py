#!/usr/bin/env python3
"""The ring's cost promise, counted: under windows, chunks and the contiguous layout's causal
order, `seqpar check`'s p2p ring forward computes exactly the steps where some query of the ring
rank's rows sees some key of the block it receives, and skips the others ("ring_steps" in
`check --json`: computed, skipped_mask, skipped_layout). The expected counts are derived here,
independently, from the layout `seqpar plan --json` gives (each rank's tokens, the documents)
and the mask's definition (docs/attention.md) — so a ring that computes a step its mask hides
(the O(S·W) promise broken, results still right) fails, as does one that skips a step with a
visible key (results wrong too, but named here by its count). A layer without a window or chunk
is promised the layout's skips only: it computes a step that its document mask alone hides
(contiguous layout, a document held by other ranks) — an optimisation not made, counted here as
computed.

Usage: ring_skips.py SEQPAR"""
import json
import subprocess
import sys

seqpar = sys.argv[1]

CASES = [
    # causal sliding windows, zigzag: the far halves of other documents' blocks are hidden
    ["--ulysses", "1", "--ring", "4", "--docs", "64,32,96", "--window", "8"],
    ["--ulysses", "2", "--ring", "4", "--docs", "64,32,96", "--window", "8"],
    # lopsided bidirectional windows
    ["--ulysses", "1", "--ring", "4", "--docs", "128,64", "--window", "12", "--mask",
     "bidirectional", "--window-right", "3"],
    # chunks (aligned to each document's start)
    ["--ulysses", "1", "--ring", "4", "--docs", "128,64", "--chunk", "16"],
    ["--ulysses", "2", "--ring", "2", "--docs", "96,64", "--chunk", "8", "--no-zigzag"],
    # contiguous: later blocks under the causal mask are the layout's skips, the window's others
    ["--ulysses", "1", "--ring", "4", "--docs", "96,32", "--window", "8", "--no-zigzag"],
    ["--ulysses", "1", "--ring", "4", "--docs", "96,32", "--no-zigzag"],
    # nothing to skip: bidirectional without a window, causal zigzag
    ["--ulysses", "1", "--ring", "4", "--docs", "96,32", "--mask", "bidirectional"],
    ["--ulysses", "1", "--ring", "4", "--docs", "96,32"],
    # two layers, a window on one (gpt-oss's pattern)
    ["--ulysses", "1", "--ring", "4", "--docs", "64,64", "--window", "4", "--layers", "2",
     "--attention-pattern", "WF"],
]


def run(args):
    p = subprocess.run([seqpar] + args, capture_output=True, text=True)
    if p.returncode not in (0, 1):
        raise SystemExit("seqpar %s exited %d: %s" % (" ".join(args), p.returncode, p.stderr))
    return json.loads(p.stdout)


def expected(plan, scn):
    U, R = scn["ulysses"], scn["ring"]
    n = plan["padded_length"]
    cu = [int(x) for x in plan["cu_seqlens"]]
    if cu[-1] < n:
        cu.append(n)   # the padding tail: a document of its own
    doc, pos = [0] * n, [0] * n
    for j, (a, b) in enumerate(zip(cu[:-1], cu[1:])):
        for t in range(a, b):
            doc[t], pos[t] = j, t - a
    ranks = sorted(plan["ranks"], key=lambda r: r["cp_rank"])
    rows = [sorted(t for u in range(U) for t in ranks[r * U + u]["tokens"]) for r in range(R)]
    causal = scn.get("mask", "causal") != "bidirectional"
    pattern = scn.get("attention_pattern") or ""
    W, Wr, C = scn.get("window", 0), scn.get("window_right", scn.get("window", 0)), \
        scn.get("chunk", 0)
    counts = {"computed": 0, "skipped_mask": 0, "skipped_layout": 0}
    for layer in range(scn["layers"]):
        kind = pattern[layer % len(pattern)] if pattern else ("W" if W else "C" if C else "F")

        def sees(q, k):
            if doc[q] != doc[k]:
                return False
            if causal and k > q:
                return False
            if kind == "W":
                if causal:
                    return q - k <= W - 1
                return q - k <= W and k - q <= Wr
            if kind == "C":
                return pos[q] // C == pos[k] // C
            return True

        for _u in range(U):
            for r in range(R):
                for i in range(R):
                    src = (r - i) % R
                    if not scn["zigzag"] and causal and src > r:
                        counts["skipped_layout"] += 1
                    elif kind == "F" or any(sees(q, k) for q in rows[r] for k in rows[src]):
                        # (a layer without a window or chunk computes every step the layout
                        # keeps, even one its document mask alone hides: no promise there)
                        counts["computed"] += 1
                    else:
                        counts["skipped_mask"] += 1
    return counts


failures = 0
skipped_any = False
for args in CASES:
    rep = run(["check", "--json", "-q"] + args)
    scn = rep["scenario"]
    plan = run(["plan", "--json"] + args)
    want = expected(plan, scn)
    got = {k: rep["ring_steps"][k] for k in want}
    ok = got == want
    skipped_any |= want["skipped_mask"] > 0
    print("%s %s: ring steps %s (derived from the layout: %s)" % (
        "ok  " if ok else "FAIL", " ".join(args), got, want), flush=True)
    failures += not ok
if not skipped_any:
    print("FAIL no case has a step its mask hides: the cases test nothing")
    failures += 1
sys.exit(1 if failures else 0)

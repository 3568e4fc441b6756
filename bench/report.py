#!/usr/bin/env python3
"""One benchmark run's report: bench/run_all.sh's directory -> report.md and scale.svg.

    bench/report.py DIR

Reads every DIR/*.json the bench driver wrote (-J) and DIR/run.log, and writes DIR/report.md
(one markdown table per program, with its baselines, ISA and notes, as docs/benchmarks.md quotes them)
and, when DIR/scale.json is there, DIR/scale.svg (seconds per 1K tokens and bytes per token
and above the fixed cost, against tokens, the check and the reference alone: flat lines are
O(S)). Standard library only.
Exit 2 when DIR holds no report or a report is not the driver's JSON.
"""
import json
import math
import os
import sys


def fail(msg):
    print(f"report.py: {msg}", file=sys.stderr)
    sys.exit(2)


def human_bytes(n):
    for unit, div in (("G", 1 << 30), ("M", 1 << 20), ("K", 1 << 10)):
        if n >= div and n % div == 0:
            return f"{n // div}{unit}"
    return str(n)


def fmt_num(v):
    if v is None:
        return "–"
    if isinstance(v, bool):
        return str(v).lower()
    if isinstance(v, int):
        return f"{v:,}"
    if isinstance(v, float):
        if v == 0:
            return "0"
        a = abs(v)
        if a >= 1000:
            return f"{v:,.0f}"
        if a >= 10:
            return f"{v:.1f}"
        if a >= 0.01:
            return f"{v:.3g}" if a < 1 else f"{v:.2f}"
        return f"{v:.2e}"
    return str(v)


def table(rows, columns):
    out = ["| " + " | ".join(columns) + " |", "|" + "|".join("---:" for _ in columns) + "|"]
    for r in rows:
        out.append("| " + " | ".join(r.get(c, "") if isinstance(r.get(c), str) else fmt_num(r.get(c)) for c in columns) + " |")
    return out


def section(name, j):
    lines = [f"### {name}: {j['op']}", ""]
    lines.append(f"`{j['program']}`, backend {j['backend']}, ranks {j['ranks']}, ISA `{j['isa']}`, "
                 f"options {json.dumps(j['options'], sort_keys=True)}.")
    for b in j.get("baselines", []):
        lines.append(f"Baseline ({b['type']}): {b['what']} = {fmt_num(b['value'])} {b['unit']}.")
    lines.append(f"Ratio: {j['ratio']}.")
    lines.append("")
    transport = j["kind"] == "transport"
    base = ["size", "count", "type"] + ([] if transport else ["case"]) + ["time_us"]
    base += ["algbw", "busbw"] if transport else ["rate"]
    extra = []
    for r in j["rows"]:
        for k in r:
            if k not in base and k not in ("ratio", "wrong") and k not in extra:
                extra.append(k)
    cols = base + extra + ["ratio", "wrong"]
    rows = []
    for r in j["rows"]:
        rr = dict(r)
        rr["size"] = human_bytes(r["size"])
        rows.append(rr)
    if not transport and j.get("rate_unit"):
        lines.append(f"rate in {j['rate_unit']}.")
        lines.append("")
    lines += table(rows, cols)
    for key in ("side", "summary"):
        side = j.get(key)
        if side and side.get("rows"):
            lines += ["", f"{side['title']}:", ""]
            scols = list(side["rows"][0].keys())
            lines += table(side["rows"], scols)
    if j.get("notes"):
        lines += [""] + [f"- {n}" for n in j["notes"]]
    lines += ["", f"#wrong in all: {fmt_num(j.get('wrong'))}", ""]
    return lines


def svg_scale(j, path):
    """Two panels against tokens (log2 x): seconds per 1K tokens, bytes per token."""
    series = {}
    for r in j["rows"]:
        series.setdefault(r["case"], []).append(r)
    if not series:
        return False
    W, H, pad = 1320, 380, 60
    pw = (W - 4 * pad) / 3
    ph = H - 2 * pad
    toks = sorted({r["count"] for r in j["rows"]})
    x0 = math.log2(toks[0])
    x1 = max(math.log2(toks[-1]), x0 + 1)  # one size: a unit-wide axis
    colors = {"check": "#1f77b4", "reference": "#d62728"}
    parts = [f'<svg xmlns="http://www.w3.org/2000/svg" width="{W}" height="{H}" font-family="sans-serif" font-size="12">',
             f'<rect width="{W}" height="{H}" fill="white"/>',
             f'<text x="{W / 2}" y="20" text-anchor="middle" font-size="14">seqpar check at scale ({j["isa"]}): '
             f'flat lines are O(S)</text>']

    def panel(ix, title, value, unit):
        left = pad + ix * (pw + pad)
        vals = [value(r) for r in j["rows"]]
        vmax = max(vals) * 1.15 if vals and max(vals) > 0 else 1
        parts.append(f'<text x="{left + pw / 2}" y="{pad - 14}" text-anchor="middle">{title}</text>')
        parts.append(f'<rect x="{left}" y="{pad}" width="{pw}" height="{ph}" fill="none" stroke="#888"/>')
        for k in range(5):
            v = vmax * k / 4
            y = pad + ph - ph * k / 4
            parts.append(f'<line x1="{left}" x2="{left + pw}" y1="{y}" y2="{y}" stroke="#eee"/>')
            parts.append(f'<text x="{left - 4}" y="{y + 4}" text-anchor="end">{fmt_num(v)}</text>')
        for t in toks:
            x = left + pw * (math.log2(t) - x0) / (x1 - x0)
            parts.append(f'<text x="{x}" y="{pad + ph + 16}" text-anchor="middle">{t // 1024}K</text>')
        parts.append(f'<text x="{left + pw / 2}" y="{pad + ph + 34}" text-anchor="middle">tokens ({unit})</text>')
        for ci, (case, rows) in enumerate(sorted(series.items())):
            pts = []
            for r in sorted(rows, key=lambda r: r["count"]):
                x = left + pw * (math.log2(r["count"]) - x0) / (x1 - x0)
                y = pad + ph - ph * value(r) / vmax
                pts.append(f"{x:.1f},{y:.1f}")
                parts.append(f'<circle cx="{x:.1f}" cy="{y:.1f}" r="3" fill="{colors.get(case, "#333")}"/>')
            parts.append(f'<polyline points="{" ".join(pts)}" fill="none" stroke="{colors.get(case, "#333")}" stroke-width="2"/>')
            parts.append(f'<text x="{left + 8}" y="{pad + 16 + 14 * ci}" fill="{colors.get(case, "#333")}">{case}</text>')

    panel(0, "seconds per 1K tokens", lambda r: r["time_us"] / 1e6 / (r["count"] / 1024), "log scale")
    panel(1, "peak RSS bytes per token", lambda r: r.get("B/token", 0), "log scale")
    panel(2, "bytes per token above the 256-token base", lambda r: r.get("B/token_above_base", 0), "log scale")
    parts.append("</svg>")
    with open(path, "w") as f:
        f.write("\n".join(parts) + "\n")
    return True


def main():
    if len(sys.argv) != 2:
        fail("usage: bench/report.py DIR (a directory bench/run_all.sh wrote)")
    d = sys.argv[1]
    if not os.path.isdir(d):
        fail(f"'{d}' is not a directory; pass the directory bench/run_all.sh wrote")
    names = sorted(n[:-5] for n in os.listdir(d) if n.endswith(".json"))
    if not names:
        fail(f"'{d}' holds no *.json report; run bench/run_all.sh {d} first")
    order = ["isa_and_attention", "a2a_2ranks", "a2a_4ranks", "reference_threads",
             "whole_check_threads", "scale", "import", "property_throughput"]
    names.sort(key=lambda n: (order.index(n) if n in order else len(order), n))
    lines = ["# seqpar benchmarks: one run", ""]
    log = os.path.join(d, "run.log")
    if os.path.exists(log):
        lines += ["```", open(log).read().rstrip(), "```", ""]
    for n in names:
        try:
            j = json.load(open(os.path.join(d, n + ".json")))
            lines += section(n, j)
        except (ValueError, KeyError) as e:
            fail(f"{d}/{n}.json is not a bench driver report ({e.__class__.__name__}: {e}); rerun that program")
    then = os.path.join(d, "property_then_now.txt")
    if os.path.exists(then):
        lines += ["### property throughput against the earlier tree (bench/property_then_now.sh)", "", "```",
                  open(then).read().rstrip(), "```", ""]
    tmp = os.path.join(d, "report.md.tmp")
    with open(tmp, "w") as f:
        f.write("\n".join(lines) + "\n")
    os.replace(tmp, os.path.join(d, "report.md"))
    if "scale" in names:
        j = json.load(open(os.path.join(d, "scale.json")))
        svg_scale(j, os.path.join(d, "scale.svg"))


if __name__ == "__main__":
    main()

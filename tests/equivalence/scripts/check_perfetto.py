"""Checks a `seqpar replay --perfetto` file against the Chrome trace-event format that Perfetto
and chrome://tracing read, and against the replay it came from.

    check_perfetto.py FILE RANKS FINDINGS [FLOWS]
RANKS: the ranks expected as processes; FINDINGS: instant events expected; FLOWS: send→recv
flows expected (default: not checked). Exit 0 when it holds, 1 with the reason otherwise."""
import json
import sys


def main():
    path, ranks, findings = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
    flows = int(sys.argv[4]) if len(sys.argv) > 4 else None
    doc = json.load(open(path))
    ev = doc["traceEvents"]
    errors = []
    for e in ev:
        for key in ("ph", "pid", "tid", "name"):
            if key not in e:
                errors.append(f"event without '{key}': {e}")
        if e.get("ph") in ("X", "i", "s", "f") and not isinstance(e.get("ts"), (int, float)):
            errors.append(f"event without a numeric ts: {e}")
        if e.get("ph") == "X" and not e.get("dur", 0) > 0:
            errors.append(f"slice without a positive dur: {e}")
        if e.get("ph") == "i" and (e.get("s") not in ("t", "p", "g") or "message" not in e["args"]):
            errors.append(f"instant event without scope or message: {e}")
    procs = {e["pid"] for e in ev if e["ph"] == "M" and e["name"] == "process_name"}
    if len(procs) != ranks:
        errors.append(f"{len(procs)} processes named, want {ranks}")
    got = sum(e["ph"] == "i" for e in ev)
    if got != findings:
        errors.append(f"{got} findings, want {findings}")
    starts = {e["id"] for e in ev if e["ph"] == "s"}
    ends = {e["id"] for e in ev if e["ph"] == "f"}
    if starts != ends:
        errors.append(f"flows without both ends: {sorted(starts ^ ends)}")
    if flows is not None and len(starts) != flows:
        errors.append(f"{len(starts)} flows, want {flows}")
    slices = sum(e["ph"] == "X" for e in ev)
    if slices == 0:
        errors.append("no call slices")
    if errors:
        print("\n".join(errors[:10]))
        return 1
    print(f"ok: {slices} slices, {ranks} ranks, {got} findings, {len(starts)} flows; "
          f"{doc['otherData']['time']}")
    return 0


if __name__ == "__main__":
    sys.exit(main())

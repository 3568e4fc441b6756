#!/usr/bin/env python3
"""Convert PyTorch Flight Recorder pickle dumps (``_dump_nccl_trace`` / the files written under
TORCH_NCCL_DEBUG_INFO_TEMP_FILE) into the JSON form ``seqpar import --from fr`` reads.

Standard library only, no torch. The unpickler is restricted: it builds only the builtin
containers and scalars (dict, list, tuple, set, str, bytes, int, float, bool, None) and refuses
every other global, so a dump cannot run code.

    python3 tools/fr_pickle_to_json.py DUMP.pkl [DUMP.pkl ...] --out-dir DIR
    python3 tools/fr_pickle_to_json.py DUMP.pkl OUT.json
"""
import argparse
import io
import json
import os
import pickle
import sys

from seqpar_recorder import write_atomic  # beside this script in tools/

_ALLOWED = {
    ("builtins", "dict"), ("builtins", "list"), ("builtins", "tuple"), ("builtins", "set"),
    ("builtins", "frozenset"), ("builtins", "str"), ("builtins", "bytes"), ("builtins", "int"),
    ("builtins", "float"), ("builtins", "bool"),
}


class _RestrictedUnpickler(pickle.Unpickler):
    def find_class(self, module, name):
        if (module, name) in _ALLOWED:
            return getattr(__import__("builtins"), name)
        raise pickle.UnpicklingError(
            f"refusing to load {module}.{name}: a Flight Recorder dump holds only dicts, lists, "
            f"strings and numbers")


def load_dump(path):
    with open(path, "rb") as f:
        data = f.read()
    try:
        return _RestrictedUnpickler(io.BytesIO(data)).load()
    except (pickle.UnpicklingError, EOFError, ValueError, TypeError) as e:
        raise SystemExit(f"fr_pickle_to_json: {path}: not a Flight Recorder pickle dump: {e}")


def _plain(x):
    """JSON-able copy: tuples → lists, sets → sorted lists, bytes → text, keys → str."""
    if isinstance(x, dict):
        return {str(k): _plain(v) for k, v in x.items()}
    if isinstance(x, (list, tuple)):
        return [_plain(v) for v in x]
    if isinstance(x, (set, frozenset)):
        return sorted(_plain(v) for v in x)
    if isinstance(x, bytes):
        return x.decode("utf-8", "replace")
    if isinstance(x, float) and (x != x or x in (float("inf"), float("-inf"))):
        return None
    return x


def convert(path):
    d = load_dump(path)
    if not isinstance(d, dict):
        raise SystemExit(f"fr_pickle_to_json: {path}: a Flight Recorder dump is a dict, got "
                         f"{type(d).__name__}")
    out = _plain(d)
    # The JSON dump keeps pg_config ranks as the string "[0, 1]"; the pickle may hold a list.
    for pg in (out.get("pg_config") or {}).values():
        if isinstance(pg, dict) and isinstance(pg.get("ranks"), list):
            pg["ranks"] = json.dumps(pg["ranks"])
    for e in out.get("entries") or []:
        if isinstance(e, dict):
            e.pop("frames", None)  # stack frames: not needed by seqpar
    return out


def main(argv):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("inputs", nargs="+", help="pickle dumps (last one may be OUT.json)")
    ap.add_argument("--out-dir", help="write <name>.json per dump into this directory")
    a = ap.parse_args(argv)
    if a.out_dir:
        os.makedirs(a.out_dir, exist_ok=True)
        pairs = [(p, os.path.join(a.out_dir, os.path.basename(p).rsplit(".pkl", 1)[0] + ".json"))
                 for p in a.inputs]
    else:
        if len(a.inputs) != 2:
            ap.error("give DUMP OUT.json, or several dumps with --out-dir")
        pairs = [(a.inputs[0], a.inputs[1])]
    for src, dst in pairs:
        write_atomic(dst, json.dumps(convert(src), indent=1))
        print(f"fr_pickle_to_json: {src} -> {dst}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))

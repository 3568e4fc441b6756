#!/usr/bin/env python3
"""Plants one error in a dump's safetensors file, in place, for the tests that pin validate
--dump's promises from the failing side (dump_sampled-test.sh):

  edit_dump.py FILE TENSOR --token T [--head H] (--add X | --scale X | --ulp)
  edit_dump.py FILE TENSOR --dtype NAME        (the header's dtype only: I32, …)

--token/--head address the tensor's first two dimensions ([tokens, heads, dim]; an LSE
[heads, tokens] is addressed the same way); without --head every head of the token changes.
--ulp moves each element one step of its own dtype's grid.
"""
import argparse
import json
import math
import struct

# Element formats (struct): BF16 is handled through its 16 bits.
FMT = {"F64": "d", "F32": "f", "F16": "e", "BF16": "H"}

ap = argparse.ArgumentParser()
ap.add_argument("file")
ap.add_argument("tensor")
ap.add_argument("--token", type=int)
ap.add_argument("--head", type=int)
ap.add_argument("--add", type=float)
ap.add_argument("--scale", type=float)
ap.add_argument("--ulp", action="store_true")
ap.add_argument("--dtype")
a = ap.parse_args()


def change(bits_or_value, dtype):
    if dtype == "BF16":
        if a.ulp:
            return bits_or_value + 1
        v = struct.unpack("<f", struct.pack("<I", bits_or_value << 16))[0]
        v = v + a.add if a.add is not None else v * a.scale
        return struct.unpack("<I", struct.pack("<f", v))[0] >> 16
    if a.ulp:
        if dtype == "F16":
            return struct.unpack("<e", struct.pack("<H", struct.unpack("<H", struct.pack("<e", bits_or_value))[0] + 1))[0]
        return math.nextafter(bits_or_value, math.inf)
    return bits_or_value + a.add if a.add is not None else bits_or_value * a.scale


with open(a.file, "r+b") as f:
    n = struct.unpack("<Q", f.read(8))[0]
    header = json.loads(f.read(n))
    t = header[a.tensor]
    if a.dtype:
        t["dtype"] = a.dtype
        text = json.dumps(header, separators=(",", ":")).encode()
        if len(text) > n:
            raise SystemExit("edit_dump: the new header does not fit")
        f.seek(8)
        f.write(text + b" " * (n - len(text)))
        raise SystemExit(0)
    begin, _ = t["data_offsets"]
    fmt = FMT[t["dtype"]]
    size = struct.calcsize(fmt)
    d0, d1 = t["shape"][0], t["shape"][1]
    inner = 1
    for x in t["shape"][2:]:
        inner *= x
    lse = a.tensor.startswith("lse")
    heads = range(d0 if lse else d1) if a.head is None else [a.head]
    for h in heads:
        first = (h * d1 + a.token) * inner if lse else (a.token * d1 + h) * inner
        for e in range(first, first + inner):
            f.seek(8 + n + begin + e * size)
            (v,) = struct.unpack("<" + fmt, f.read(size))
            f.seek(8 + n + begin + e * size)
            f.write(struct.pack("<" + fmt, change(v, t["dtype"])))

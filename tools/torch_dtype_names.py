#!/usr/bin/env python3
"""Writes what a real torch calls each dtype in the places seqpar's importers read them
(traces/torch-dtype-names/names.json, the fixture of traces-test's dtype tables):

  cpp      the profiler's "Input type" (Kineto traces: the C++ type's name, `c10::BFloat16`)
  c10      c10's ScalarType name (Flight Recorder's input_dtypes: `BFloat16`)
  number   c10's ScalarType as an integer (Flight Recorder 2.1's dtypes: 15)

each beside seqpar's trace dtype name (torch's own dtype name without "torch.").

    .venv/bin/python tools/torch_dtype_names.py [OUT]
"""
import json
import sys
import warnings

import torch
from torch.profiler import ProfilerActivity, profile

DTYPES = [torch.float32, torch.float64, torch.float16, torch.bfloat16, torch.int8, torch.uint8,
          torch.int16, torch.int32, torch.int64, torch.bool, torch.float8_e4m3fn,
          torch.float8_e5m2]


def main():
    warnings.filterwarnings("ignore")
    out = sys.argv[1] if len(sys.argv) > 1 else "traces/torch-dtype-names/names.json"
    tensors = [torch.zeros(4, dtype=d) for d in DTYPES]
    with profile(activities=[ProfilerActivity.CPU], record_shapes=True) as prof:
        for t in tensors:
            t.clone()
    import os
    import tempfile
    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "trace.json")
        prof.export_chrome_trace(path)
        with open(path) as f:
            events = [e for e in json.load(f)["traceEvents"] if e.get("name") == "aten::clone"]
    if len(events) != len(DTYPES):
        sys.exit(f"expected {len(DTYPES)} aten::clone events, the profile has {len(events)}")
    rows = []
    for d, t, e in zip(DTYPES, tensors, events):
        rows.append({"dtype": str(d).removeprefix("torch."),
                     "cpp": e["args"]["Input type"][0],
                     "c10": torch._C.TensorType.create_from_tensor(t).scalarType(),
                     "number": torch.ops.prim.dtype(t)})
    with open(out, "w") as f:
        json.dump({"torch": torch.__version__, "dtypes": rows}, f, indent=1)
        f.write("\n")
    print(f"wrote {out}: {len(rows)} dtypes from torch {torch.__version__}")


if __name__ == "__main__":
    main()

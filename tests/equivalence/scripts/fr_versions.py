"""Flight Recorder JSON dumps of one small 2-rank job in every dump version torch has defined,
written from the definitions (torch's TraceUtils.h / NCCLUtils.hpp / FlightRecorder.hpp keys and
value types per version; no torch needed), healthy and broken, for `seqpar import --from fr`.

    fr_versions.py OUT_DIR

OUT_DIR/<version>/<variant>/nccl_trace_rank_{0,1}.json, variant healthy | size (rank 1's last
all_reduce has one element more) | dtype (rank 1's first all_reduce is Double; versions that
record dtypes). Versions: 0 (the bare list, torch ~2.2), 1.0, 1.1, 1.4, 2.0, 2.1 (integer
dtypes), 2.2, 2.3, 2.4, 2.7, 2.10, and 3.0 (a future one). The job, per rank: all_reduce [3, 4],
all_to_all [8, 4], a send 0->1 / recv 1<-0, all_reduce [16].
"""
import json
import os
import sys

VERSIONS = ["0", "1.0", "1.1", "1.4", "2.0", "2.1", "2.2", "2.3", "2.4", "2.7", "2.10", "3.0"]


def parts(v):
    major, _, minor = v.partition(".")
    return int(major), int(minor or 0)


def entries(version, rank, variant):
    v = parts(version)
    ops = [("nccl:all_reduce", [[3, 4]], [[3, 4]]),
           ("nccl:all_to_all", [[8, 4]], [[8, 4]]),
           ("nccl:send 0->1" if rank == 0 else "nccl:recv 1<-0", [[5]] if rank == 0 else [],
            [] if rank == 0 else [[5]]),
           ("nccl:all_reduce", [[16]], [[16]])]
    if variant == "size" and rank == 1:
        ops[3] = ("nccl:all_reduce", [[17]], [[17]])
    if v < (2, 4):  # all-to-all sizes are logged from 2.4 on
        ops[1] = ("nccl:all_to_all", [], [])
    out, coll, p2p = [], 0, 0
    for i, (name, ins, outs) in enumerate(ops):
        is_p2p = "send" in name or "recv" in name
        if is_p2p:
            p2p += 1
        else:
            coll += 1
        e = {}
        if v >= (1, 4):
            e["record_id"] = i
        e["pg_id"] = 0
        if v >= (2, 0):
            e["process_group"] = ["0", "default_pg"]
        if v >= (2, 10):
            e["thread_name"] = "pt_main_thread"
            e["thread_id"] = "140234567890"
        if v >= (2, 0):
            e["collective_seq_id"] = coll
            e["p2p_seq_id"] = p2p
        else:
            e["seq_id"] = i + 1
        if v >= (1, 4):
            e["op_id"] = i + 1
        e["profiling_name"] = name
        e["time_created_ns"] = 1718000000000000000 + 1000 * i
        e["input_sizes"] = ins
        dt = "Double" if variant == "dtype" and rank == 1 and i == 0 else "Float"
        if v >= (2, 1):
            code = {"Float": 6, "Double": 7}[dt]
            e["input_dtypes"] = [code if v == (2, 1) else dt for _ in ins]
        e["output_sizes"] = outs
        if v >= (2, 1):
            e["output_dtypes"] = [code if v == (2, 1) else dt for _ in outs]
        e["state"] = "completed"
        if v >= (1, 1):
            e["time_discovered_started_ns"] = 1718000000000000100 + 1000 * i
            e["time_discovered_completed_ns"] = 1718000000000000200 + 1000 * i
        e["retired"] = True
        if v >= (2, 2):
            e["timeout_ms"] = 600000
            e["is_p2p"] = is_p2p
        if v < (2, 2):
            e["frames"] = []
        out.append(e)
    return out


def dump(version, rank, variant):
    es = entries(version, rank, variant)
    if version == "0":
        return es
    d = {"version": version}
    v = parts(version)
    if v >= (2, 10):
        d["comm_lib_version"] = "2.21.5"
    if v >= (2, 0):
        d["pg_config"] = {"0": {"name": "0", "desc": "default_pg", "ranks": "[0, 1]"}}
    elif v >= (1, 4):
        d["pg_config"] = {"0": [0, 1]}
    if v >= (2, 3):
        status = {"last_enqueued_collective": 3, "last_started_collective": 3,
                  "last_completed_collective": 3}
        d["pg_status"] = {"0": {k: str(x) for k, x in status.items()}}
    d["entries"] = es
    return d


def main():
    out = sys.argv[1]
    for version in VERSIONS:
        for variant in ("healthy", "size", "dtype"):
            if variant == "dtype" and parts(version) < (2, 1):
                continue
            d = os.path.join(out, version, variant)
            os.makedirs(d, exist_ok=True)
            for rank in (0, 1):
                with open(os.path.join(d, f"nccl_trace_rank_{rank}.json"), "w") as f:
                    json.dump(dump(version, rank, variant), f)


if __name__ == "__main__":
    main()

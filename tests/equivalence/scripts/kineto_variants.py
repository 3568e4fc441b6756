"""Broken variants of a real job's torch ~2.0 Kineto traces (one .json.gz per rank; the rank is
distributedInfo.rank), for `seqpar import --from kineto` + `seqpar replay`.

    kineto_variants.py SRC_DIR OUT_DIR

OUT_DIR/<variant>/ receives the rank files (gzipped JSON):
  one_more      rank 5's all_reduce of 394241 elements carries one element more
  float64_rank  rank 3's collectives are double where the others' are float
  stops         rank 6's profile stops after its 4th collective (the later nccl: events gone)
  missing_file  rank 7's file is absent
  alone         rank 2's file only
"""
import gzip
import json
import os
import sys


def load(src):
    ranks = {}
    for name in sorted(os.listdir(src)):
        with gzip.open(os.path.join(src, name), "rt") as f:
            doc = json.load(f)
        ranks[doc["distributedInfo"]["rank"]] = (name, doc)
    return ranks


def backend_events(doc):
    evs = [e for e in doc["traceEvents"]
           if e.get("name", "").startswith(("nccl:", "gloo:"))
           and e.get("cat") != "gpu_user_annotation"]
    return sorted(evs, key=lambda e: e["ts"])


def write(out, variant, ranks, keep=lambda r: True):
    d = os.path.join(out, variant)
    os.makedirs(d, exist_ok=True)
    for r, (name, doc) in ranks.items():
        if keep(r):
            with gzip.open(os.path.join(d, name), "wt") as f:
                json.dump(doc, f)


def main():
    src, out = sys.argv[1], sys.argv[2]
    ranks = load(src)
    doc5 = ranks[5][1]
    hit = [e for e in backend_events(doc5) if e["args"].get("Input Dims") == [[394241]]]
    assert hit, "rank 5 has no all_reduce of 394241 elements"
    hit[0]["args"]["Input Dims"] = [[394242]]
    write(out, "one_more", ranks)
    ranks = load(src)
    for e in backend_events(ranks[3][1]):
        e["args"]["Input type"] = ["double" if t == "float" else t for t in e["args"]["Input type"]]
    write(out, "float64_rank", ranks)
    ranks = load(src)
    late = {id(e) for e in backend_events(ranks[6][1])[4:]}
    ranks[6][1]["traceEvents"] = [e for e in ranks[6][1]["traceEvents"] if id(e) not in late]
    write(out, "stops", ranks)
    ranks = load(src)
    write(out, "missing_file", ranks, keep=lambda r: r != 7)
    write(out, "alone", ranks, keep=lambda r: r == 2)


if __name__ == "__main__":
    main()

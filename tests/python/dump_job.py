"""One rank's attention dumped by seqpar.dump, for test_recorder_failsafe.py.

    dump_job.py DIR MODE     MODE: healthy | fsize (a file past 12 KB cannot be written, as on a full disk: the calls grow, so
the later ones fail) | hold
"""
import os
import resource
import signal
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, "..", "..", "python"))
import torch  # noqa: E402

import seqpar.dump as sd  # noqa: E402


def main():
    d, mode = sys.argv[1], sys.argv[2]
    S, H, D = 8, 2, 4
    dumper = sd.Dumper(d, ulysses=1, ring=1, ulysses_rank=0, ring_rank=0, heads=H, kv_heads=H,
                       head_dim=D, scale=D ** -0.5, causal=True, cu_seqlens=[0, S],
                       position_ids=list(range(S)), rank=0, world_size=1, durable=False)
    if mode == "fsize":
        signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
        resource.setrlimit(resource.RLIMIT_FSIZE, (12000, resource.RLIM_INFINITY))
    for i in range(6):
        q = torch.randn(S * 8 * (i + 1), H, D, requires_grad=True)
        with dumper.call("L%d.attn" % i):
            out = dumper.tap("q.local", q) * 2
            dumper.tap("out.local", out)
        out.sum().backward()
    if mode == "hold":
        print("dumping", flush=True)
        time.sleep(60)
    dumper.close()
    resource.setrlimit(resource.RLIMIT_FSIZE, (resource.RLIM_INFINITY, resource.RLIM_INFINITY))
    print("training finished", flush=True)


if __name__ == "__main__":
    main()

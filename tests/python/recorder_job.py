"""A one-process gloo job under seqpar.recorder, for test_recorder_failsafe.py.

    recorder_job.py OUT.jsonl MODE
MODE: healthy | fsize (a file size limit hit mid-run: the disk is "full") | hold (records, then
sleeps holding the stream until killed: a job still running)."""
import os
import resource
import signal
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, "..", "..", "python"))
import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

import seqpar.recorder as spr  # noqa: E402


def main():
    out, mode = sys.argv[1], sys.argv[2]
    store = tempfile.mktemp(prefix="seqpar-rec-store-")
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=0, world_size=1)
    rec = spr.Recorder(out)
    if mode == "fsize":
        # Writes beyond 700 bytes fail (EFBIG) as on a full disk; the signal it raises is ignored
        # so the write returns the error instead of killing the process.
        signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
        resource.setrlimit(resource.RLIMIT_FSIZE, (700, resource.RLIM_INFINITY))
    x = torch.ones(4)
    for i in range(20):
        with rec.tag(f"step{i}"):
            dist.all_reduce(x)
    if mode == "hold":
        print("recording", flush=True)
        time.sleep(60)
    resource.setrlimit(resource.RLIMIT_FSIZE, (resource.RLIM_INFINITY, resource.RLIM_INFINITY))
    print(f"training finished: x = {x[0].item():.0f}", flush=True)
    if mode == "fsize":
        rec.uninstall()  # the stream is what the test reads
    else:
        rec.close()  # one rank: writes the merged OUT.jsonl
    dist.destroy_process_group()
    print("error:", rec.write_error is not None, flush=True)


if __name__ == "__main__":
    main()

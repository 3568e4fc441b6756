"""torch's public context_parallel() on gloo CPU ranks (2 processes), around
F.scaled_dot_product_attention, both rotate methods: prints what each does. Measured with torch
2.11: it raises (no sharding strategy for the CPU SDPA kernel), so test_frameworks.py calls the
ring below the public API; a GPU run uses the public API as it is."""
import datetime
import os
import socket
import sys

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import torch.nn.functional as F


def _rank(rank, port, q_out):
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=2,
                            timeout=datetime.timedelta(seconds=60))
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor.experimental import context_parallel
    from torch.distributed.tensor.experimental._attention import set_rotate_method
    mesh = init_device_mesh("cpu", (2,))
    for method in ("allgather", "alltoall"):
        set_rotate_method(method)
        q, k, v = (torch.randn(1, 2, 16, 8) for _ in range(3))
        try:
            with context_parallel(mesh, buffers=[q, k, v], buffer_seq_dims=[2, 2, 2]):
                F.scaled_dot_product_attention(q, k, v, is_causal=True)
            what = "ran"
        except Exception as e:  # noqa: BLE001 - what torch says is the result
            what = "%s: %s" % (type(e).__name__, str(e).splitlines()[0][:200])
        if rank == 0:
            q_out.put("rotate %s: %s" % (method, what))
    dist.destroy_process_group()


def main():
    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    port = s.getsockname()[1]
    s.close()
    ctx = mp.get_context("spawn")
    q = ctx.Queue()
    ps = [ctx.Process(target=_rank, args=(r, port, q)) for r in range(2)]
    for p in ps:
        p.start()
    for p in ps:
        p.join(240)
    print("torch", torch.__version__)
    while not q.empty():
        print(q.get())
    return 0 if all(p.exitcode == 0 for p in ps) else 1


if __name__ == "__main__":
    sys.exit(main())

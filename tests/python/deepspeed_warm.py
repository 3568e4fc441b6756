"""DeepSpeed's first deepspeed.init_distributed() on a CPU machine compiles its shared-memory
comm op (deepspeed_shm_comm, through torch.utils.cpp_extension: 27 s on 2 cores, cached under
~/.cache/torch_extensions afterwards). Ranks that start at once wait on its file lock, past a
property's per-example deadline; this builds it in one process first (test_frameworks.py)."""
import datetime
import os
import socket
import time

import torch.distributed as dist

s = socket.socket()
s.bind(("127.0.0.1", 0))
os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(s.getsockname()[1]))
s.close()
dist.init_process_group("gloo", rank=0, world_size=1, timeout=datetime.timedelta(seconds=600))
t = time.time()
import deepspeed  # noqa: E402

deepspeed.init_distributed(dist_backend="gloo", verbose=False)
print("deepspeed %s: init_distributed in %.1f s" % (deepspeed.__version__, time.time() - t))
dist.destroy_process_group()

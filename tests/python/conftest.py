"""Shards of one pytest file, so that no meson test runs longer than a few minutes and the two
CI cores share the long files: SEQPAR_PYTEST_SHARD="i/n" keeps the collected tests whose index
(in collection order, parametrized cases interleaved) is i modulo n (tests/python/meson.build)."""
import os
import subprocess
import sys

import pytest

HERE = os.path.dirname(os.path.abspath(__file__))


def pytest_collection_modifyitems(config, items):
    shard = os.environ.get("SEQPAR_PYTEST_SHARD")
    if not shard:
        return
    i, n = (int(x) for x in shard.split("/"))
    keep = [t for k, t in enumerate(items) if k % n == i]
    drop = [t for k, t in enumerate(items) if k % n != i]
    if drop:
        config.hook.pytest_deselected(items=drop)
    items[:] = keep


@pytest.fixture(scope="module")
def deepspeed_comm_built():
    """DeepSpeed compiles a C++ op at its first init on a CPU machine (deepspeed_warm.py): done
    once before a module's DeepSpeed tests, so that no test's deadline pays for it."""
    p = subprocess.run([sys.executable, os.path.join(HERE, "deepspeed_warm.py")],
                       capture_output=True, text=True, timeout=600)
    assert p.returncode == 0, p.stdout[-2000:] + p.stderr[-2000:]

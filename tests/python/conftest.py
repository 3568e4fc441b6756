"""Shards of one pytest file, so that no meson test runs longer than a few minutes and the two
CI cores share the long files: SEQPAR_PYTEST_SHARD="i/n" keeps the collected tests whose index
(in collection order, parametrized cases interleaved) is i modulo n (tests/python/meson.build)."""
import os


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

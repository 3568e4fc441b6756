"""seqpar's PyTorch side.

- ``seqpar.dump``: the hook that writes a job's attention, rank by rank, for
  ``seqpar validate --dump`` (format: docs/dump_format.md).
- ``seqpar.recorder``: records a job's collectives as a seqpar-trace/1 trace for ``seqpar replay``.
- ``seqpar.testing``: property tests of *your* sequence-parallel attention: generated layouts,
  run on gloo CPU ranks, judged by ``seqpar validate --dump``, each failure shrunk.

Importing the package imports nothing heavy; each module imports torch itself.
"""
__version__ = "0.1.0"

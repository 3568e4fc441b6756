"""seqpar's PyTorch side.

- ``seqpar.dump``: the hook that writes a job's attention, rank by rank, for
  ``seqpar validate --dump`` (format: docs/dump_format.md).
- ``seqpar.recorder``: records a job's collectives as a seqpar-trace/1 trace for ``seqpar replay``.
- ``seqpar.testing``: property tests of *your* sequence-parallel attention: generated layouts,
  run on gloo CPU ranks, judged by ``seqpar validate --dump``, each failure shrunk.

Importing the package imports nothing heavy; each module imports torch itself.
"""


def _version():
    """The release, from its one place: meson.build's project() (a checkout: python/seqpar
    beside it), or the installed wheel's metadata (which meson-python took from there)."""
    import os
    import re
    build = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..", "meson.build")
    try:
        with open(build) as f:
            m = re.search(r"project\('seqpar'.*?version\s*:\s*'([^']+)'", f.read(), re.S)
        if m:
            return m.group(1)
    except OSError:
        pass
    try:
        from importlib import metadata
        return metadata.version("seqpar")
    except Exception:
        return "unknown"


__version__ = _version()

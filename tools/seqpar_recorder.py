"""Shim: the recorder lives in python/seqpar/recorder.py (`import seqpar.recorder`). Kept so that
`import seqpar_recorder` (tools/ on the path) and `python3 tools/seqpar_recorder.py merge …` keep
working."""
import os
import sys

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "python"))
from seqpar.recorder import *  # noqa: E402,F401,F403
from seqpar.recorder import Recorder, merge, recording, write_atomic, main  # noqa: E402,F401

if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))

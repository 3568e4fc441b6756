"""Shim: the dump hook lives in python/seqpar/dump.py (`import seqpar.dump`). Kept so that
scripts with tools/ on their path (`import seqpar_dump`) keep working."""
import os
import sys

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "python"))
from seqpar.dump import *  # noqa: E402,F401,F403
from seqpar.dump import Dumper, NullDumper, from_env, read_safetensors, write_safetensors  # noqa: E402,F401

"""Imported first by conftest.py: the suite's processes cache the bytecode of what they import.

Machines like CI's set PYTHONDONTWRITEBYTECODE, and the test command installs without compiling (`pip install
--no-compile`: 1 min 9 s against 2 min 13 s here, for the .pyc of every file of torch, transformers and the rest).
With neither, each of the suite's hundreds of interpreters would compile torch's imports anew: 11.4 s to import
torch, transformers, hivemind and the peer against 4.8 s from bytecode, here. So the first process to import a
module compiles and caches it, and every later one reads the cache."""

import os
import sys

os.environ.pop("PYTHONDONTWRITEBYTECODE", None)  # the suite's subprocesses: the CLI, peers, testnets, benchmarks
sys.dont_write_bytecode = False

"""``python without_finalizing.py SCRIPT ARGS``: run SCRIPT as python would, then end the
process without the interpreter's finalization, as a rank of ``morphling run`` ends.

Under plain torchrun, a rank may abort at exit after it printed everything: a gloo worker
thread still freeing the last operation frees tensors Python let go of while finalizing,
which takes the GIL, and the thread is ended in a destructor that may not throw
("terminate called without an active exception"; one run in ten or so on a loaded host).
The tests' and the benchmarks' torchrun references read what the ranks print, so they
skip finalization."""

import os
import runpy
import sys

sys.argv = sys.argv[1:]
runpy.run_path(sys.argv[0], run_name="__main__")
sys.stdout.flush()
sys.stderr.flush()
os._exit(0)

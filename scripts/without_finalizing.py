"""``python without_finalizing.py SCRIPT ARGS``: run SCRIPT as python would, then end the
process without the interpreter's finalization, as a rank of ``morphling run`` ends
(``morphling.exiting`` says why: under plain torchrun, one run in ten or so on a loaded
host aborts at exit after it printed everything). The tests' and the benchmarks' torchrun
references read what the ranks print, so they run their scripts through this."""

import runpy
import sys

from morphling.exiting import exit_without_finalizing

sys.argv = sys.argv[1:]
runpy.run_path(sys.argv[0], run_name="__main__")
exit_without_finalizing(0)

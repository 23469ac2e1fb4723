"""Ending a process that ran torch.distributed without the interpreter's finalization.

A gloo worker thread may still hold a process's last operation when Python finalizes;
freeing its tensors, which Python let go of while finalizing, takes the GIL, and Python
ends the thread inside a destructor that may not throw: the process aborts ("terminate
called without an active exception"; pytorch/pytorch#179291). ``exit_without_finalizing``
does what finalization would that matters (the atexit handlers, every open file flushed:
a script's log it never closed, say) and frees nothing, since freeing a process group
joins gloo's threads.
"""

from __future__ import annotations

import atexit
import contextlib
import gc
import io
import os
from typing import NoReturn


def exit_without_finalizing(code: int) -> NoReturn:
    """End this process with ``code``: the atexit handlers run, open files flushed."""
    atexit._run_exitfuncs()
    for stream in gc.get_objects():
        if isinstance(stream, io.IOBase) and not stream.closed:
            with contextlib.suppress(OSError, ValueError):
                stream.flush()
    os._exit(code)

"""A rank that all-reduces temporaries (tensors Python lets go of while gloo still holds
them) under ``Collectives``, asynchronously and not; prints how many it reported.

Gloo's worker thread then frees them, taking the GIL, under the lock its enqueue takes:
a hook that enqueued holding the GIL deadlocked here within a few hundred operations."""

import faulthandler
import json
import sys

import torch
import torch.distributed as dist
from morphling.proxy.job.collectives import Collectives

faulthandler.dump_traceback_later(60, exit=True)  # a deadlock: its stacks, then exit 1
count = int(sys.argv[1])
reported: list[str] = []
dist.init_process_group("gloo")
with Collectives(lambda op, *_: reported.append(op)):
    for i in range(count):
        work = dist.all_reduce(torch.ones(64), async_op=i % 2 == 0)
        if work is not None:
            work.wait()
        del work
    dist.barrier()
print(json.dumps({"rank": dist.get_rank(), "reported": len(reported)}), flush=True)
dist.destroy_process_group()

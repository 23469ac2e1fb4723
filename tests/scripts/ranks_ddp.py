"""DDP over gloo, as torchrun runs it: an MLP (or, with argv[5] "cnn", a small CNN with a
depthwise and a strided convolution; "tiny", one small linear layer, for runs of thousands
of ranks), each rank its own data; prints its losses."""

import ctypes
import json
import sys

import torch
import torch.distributed as dist
from torch import nn

STEPS = int(sys.argv[1]) if len(sys.argv) > 1 else 4
CRASH_AT = int(sys.argv[2]) if len(sys.argv) > 2 else -1  # rank 1 raises at this step
LEAVE_AT = int(sys.argv[3]) if len(sys.argv) > 3 else -1  # rank 1 ends well at this step
STUCK_AT = int(sys.argv[4]) if len(sys.argv) > 4 else -1  # rank 1 blocks holding the GIL
MODEL = sys.argv[5] if len(sys.argv) > 5 else "mlp"

dist.init_process_group("gloo")
rank = dist.get_rank()
torch.manual_seed(0)
if MODEL == "cnn":
    model = nn.Sequential(
        nn.Conv2d(3, 8, 3, padding=1), nn.ReLU(), nn.Conv2d(8, 8, 3, stride=2, groups=8),
        nn.ReLU(), nn.Flatten(), nn.Linear(8 * 7 * 7, 10),
    )  # fmt: skip
    shape: tuple[int, ...] = (16, 3, 16, 16)
elif MODEL == "tiny":
    model, shape = nn.Linear(16, 10), (8, 16)
else:
    model = nn.Sequential(nn.Linear(256, 512), nn.ReLU(), nn.Linear(512, 10))
    shape = (64, 256)
ddp = nn.parallel.DistributedDataParallel(model)
opt = torch.optim.SGD(ddp.parameters(), lr=0.1)
data = torch.Generator().manual_seed(100 + rank)
losses = []
for step in range(STEPS):
    if rank == 1 and step == CRASH_AT:
        raise RuntimeError("rank 1 fails on purpose")
    if rank == 1 and step == LEAVE_AT:
        sys.exit(0)
    while rank == 1 and step == STUCK_AT:  # as in a deadlock in C: not even a heartbeat
        ctypes.PyDLL(None).sleep(3600)  # (a PyDLL call keeps the GIL; a signal ends it)
    x, y = torch.randn(shape, generator=data), torch.randint(0, 10, shape[:1], generator=data)
    loss = nn.functional.cross_entropy(ddp(x), y)
    opt.zero_grad()
    loss.backward()
    opt.step()
    losses.append(loss.item())
print(json.dumps({"rank": rank, "losses": losses}), flush=True)
dist.destroy_process_group()

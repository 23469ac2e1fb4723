"""DDP over gloo of one small linear layer, argv[1] SGD steps: the least a data-parallel
step does (a product forward, two back, one all-reduce), for runs of thousands of ranks."""

import json
import sys

import torch
import torch.distributed as dist
from torch import nn

STEPS = int(sys.argv[1]) if len(sys.argv) > 1 else 1

dist.init_process_group("gloo")
rank = dist.get_rank()
torch.manual_seed(0)
ddp = nn.parallel.DistributedDataParallel(nn.Linear(16, 4))
opt = torch.optim.SGD(ddp.parameters(), lr=0.1)
data = torch.Generator().manual_seed(100 + rank)
losses = []
for _ in range(STEPS):
    x, y = torch.randn(8, 16, generator=data), torch.randint(0, 4, (8,), generator=data)
    loss = nn.functional.cross_entropy(ddp(x), y)
    opt.zero_grad()
    loss.backward()
    opt.step()
    losses.append(loss.item())
print(json.dumps({"rank": rank, "losses": losses}), flush=True)
dist.destroy_process_group()

"""FSDP2 (``fully_shard`` per layer, then the model) over gloo on CPU: each rank holds a
shard of every parameter, all-gathers them for the forward and backward passes and
reduce-scatters the gradients; prints its losses."""

import json

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.fsdp import fully_shard

STEPS = 3

dist.init_process_group("gloo")
rank = dist.get_rank()
torch.manual_seed(0)
model = nn.Sequential(nn.Linear(64, 128), nn.ReLU(), nn.Linear(128, 8))
for layer in model:
    if isinstance(layer, nn.Linear):
        fully_shard(layer)
fully_shard(model)
opt = torch.optim.SGD(model.parameters(), lr=0.1)
data = torch.Generator().manual_seed(5 + rank)
losses = []
for _ in range(STEPS):
    x, y = torch.randn(16, 64, generator=data), torch.randint(0, 8, (16,), generator=data)
    loss = nn.functional.cross_entropy(model(x), y)
    opt.zero_grad()
    loss.backward()
    opt.step()
    losses.append(loss.item())
print(json.dumps({"rank": rank, "losses": losses}), flush=True)
dist.destroy_process_group()

"""FedAvg: each rank trains E local steps on its own data, then the weights are averaged
with an all-reduce (synchronous); prints its losses."""

import json

import torch
import torch.distributed as dist
from torch import nn

ROUNDS, LOCAL_STEPS = 3, 2

dist.init_process_group("gloo")
rank, world = dist.get_rank(), dist.get_world_size()
torch.manual_seed(0)
model = nn.Sequential(nn.Linear(128, 256), nn.Tanh(), nn.Linear(256, 4))
opt = torch.optim.SGD(model.parameters(), lr=0.05)
data = torch.Generator().manual_seed(7 + rank)
losses = []
for _ in range(ROUNDS):
    for _ in range(LOCAL_STEPS):
        x, y = torch.randn(32, 128, generator=data), torch.randint(0, 4, (32,), generator=data)
        loss = nn.functional.cross_entropy(model(x), y)
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(loss.item())
    with torch.no_grad():
        for p in model.parameters():
            dist.all_reduce(p)
            p /= world
print(json.dumps({"rank": rank, "losses": losses}), flush=True)
dist.destroy_process_group()

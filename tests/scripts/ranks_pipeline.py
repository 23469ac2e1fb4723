"""A two-stage pipeline with send/recv: rank 0 holds the first layer and sends its
activations, rank 1 the second and sends their gradient back; then an all-reduce of the
step count over both (a group's operation beside the pair's); prints its losses."""

import json

import torch
import torch.distributed as dist
from torch import nn

STEPS = 3

dist.init_process_group("gloo")
rank = dist.get_rank()
torch.manual_seed(0)
first, second = nn.Linear(128, 256), nn.Linear(256, 8)
stage = first if rank == 0 else second
opt = torch.optim.SGD(stage.parameters(), lr=0.1)
data = torch.Generator().manual_seed(3)
losses = []
for _ in range(STEPS):
    x, y = torch.randn(16, 128, generator=data), torch.randint(0, 8, (16,), generator=data)
    opt.zero_grad()
    if rank == 0:
        h = torch.relu(first(x))
        dist.send(h.detach(), dst=1)
        grad = torch.empty_like(h)
        dist.recv(grad, src=1)
        h.backward(grad)
    else:
        h = torch.empty(16, 256)
        dist.recv(h, src=0)
        h.requires_grad_()
        loss = nn.functional.cross_entropy(second(h), y)
        loss.backward()
        dist.send(h.grad, dst=0)
        losses.append(loss.item())
    opt.step()
steps = torch.tensor([float(STEPS)])
dist.all_reduce(steps)
assert steps.item() == 2 * STEPS
print(json.dumps({"rank": rank, "losses": losses}), flush=True)
dist.destroy_process_group()

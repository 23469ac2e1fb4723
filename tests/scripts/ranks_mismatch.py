"""Ranks that all-reduce tensors of different sizes: gloo's error, as under torchrun."""

import torch
import torch.distributed as dist

dist.init_process_group("gloo")
rank = dist.get_rank()
tensor = torch.ones(1000 * (rank + 1))  # rank 1's is twice rank 0's
dist.all_reduce(tensor)
print(f"rank {rank} reduced {tensor.sum().item()}", flush=True)
dist.destroy_process_group()

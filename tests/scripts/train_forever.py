"""Train a small MLP until stopped, printing ``step N`` after each optimizer step.

Used by tests/commands/test_signals.py: a signal must arrive mid-training. It stops by itself
after LIMIT_S (a safety net should a test not stop it).
"""

import time

import torch

LIMIT_S = 300

torch.manual_seed(0)
model = torch.nn.Sequential(torch.nn.Linear(256, 256), torch.nn.ReLU(), torch.nn.Linear(256, 64))
opt = torch.optim.SGD(model.parameters(), lr=0.01)
start, step = time.monotonic(), 0
while time.monotonic() - start < LIMIT_S:
    opt.zero_grad()
    model(torch.randn(64, 256)).square().mean().backward()
    opt.step()
    step += 1
    print(f"step {step}", flush=True)

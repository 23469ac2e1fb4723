"""Train a small hand-written causal transformer that calls fused attention directly.

Used by tests/commands/test_run.py (see ``_training``).
Per step the model does LINEARS ``nn.Linear`` calls and ATTENTION calls to
``F.scaled_dot_product_attention``; the test derives the expected GEMM count from them.
"""

import torch
import torch.nn.functional as F
from _training import BATCH, SEQ, train
from torch import nn

VOCAB, DIM, HEADS, LAYERS = 128, 32, 4, 2
LINEARS = 4 * LAYERS + 1  # qkv, out, fc1, fc2 per block, then the head
ATTENTION = LAYERS


class Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.norm1, self.norm2 = nn.LayerNorm(DIM), nn.LayerNorm(DIM)
        # No bias on Q, K, V: softmax ignores a key bias, so its gradient is rounding noise
        # that AdamW (which normalises the update) would turn into a random walk.
        self.qkv, self.out = nn.Linear(DIM, 3 * DIM, bias=False), nn.Linear(DIM, DIM)
        self.fc1, self.fc2 = nn.Linear(DIM, 4 * DIM), nn.Linear(4 * DIM, DIM)
        self.drop = nn.Dropout(0.1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, _ = x.shape
        q, k, v = self.qkv(self.norm1(x)).view(b, t, 3, HEADS, DIM // HEADS).unbind(2)
        att = F.scaled_dot_product_attention(
            q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), is_causal=True
        )
        x = x + self.drop(self.out(att.transpose(1, 2).reshape(b, t, DIM)))
        return x + self.drop(self.fc2(F.gelu(self.fc1(self.norm2(x)))))


class TinyLM(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(VOCAB, DIM)
        self.blocks = nn.Sequential(*(Block() for _ in range(LAYERS)))
        self.head = nn.Linear(DIM, VOCAB)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self.head(self.blocks(self.embed(ids)))


def main() -> None:
    torch.manual_seed(0)
    model = TinyLM()

    def step_loss() -> torch.Tensor:
        ids = torch.randint(0, VOCAB, (BATCH, SEQ + 1))
        logits = model(ids[:, :-1])
        return F.cross_entropy(logits.reshape(-1, VOCAB), ids[:, 1:].reshape(-1))

    train(model, step_loss)


if __name__ == "__main__":
    main()

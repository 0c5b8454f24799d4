"""Small adversarial models and deterministic per-(rank, step) data for the tests."""

from __future__ import annotations

import torch
from torch import nn

from powertrain.models import GPT, GPTConfig

#: The GPT of the tensor-parallel parity tests (test_rtp, test_tp): every Linear and Embedding width (32, 96, 128,
#: 64) and the heads (2) divide by 2 and 4 ranks.
PARITY_GPT = GPTConfig(64, 16, 2, 2, 32)


class Adversarial(nn.Module):
    """Conv weight, odd 7x15 matrix, two same-shape matrices, biases, a frozen and an unused layer."""

    def __init__(self, dtype: torch.dtype = torch.float32) -> None:
        super().__init__()
        self.conv = nn.Conv2d(3, 8, 3)  # weight (8, 3, 3, 3): compressed as 8 x 27
        self.fc1 = nn.Linear(72, 32)
        self.big = nn.Linear(32, 32)
        self.big2 = nn.Linear(32, 32)  # same shape as big: one batch
        self.proj = nn.Linear(32, 15)
        self.odd = nn.Linear(15, 7)  # weight 7 x 15
        self.frozen = nn.Linear(7, 7)
        self.frozen.requires_grad_(False)
        self.unused = nn.Linear(4, 4)  # never in the forward pass: its .grad stays None
        self.to(dtype)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = torch.relu(self.conv(x)).flatten(1)
        h = torch.tanh(self.fc1(h))
        h = torch.tanh(self.big(h)) + torch.tanh(self.big2(h))
        return self.frozen(self.odd(torch.tanh(self.proj(h))))


def batch(rank: int, step: int, dtype: torch.dtype = torch.float32, n: int = 8) -> tuple[torch.Tensor, torch.Tensor]:
    """Different data on every rank and step, reproducible in any process."""
    g = torch.Generator().manual_seed(1000 * rank + step)
    x = torch.randn(n, 3, 5, 5, generator=g).to(dtype)
    y = torch.randn(n, 7, generator=g).to(dtype)
    return x, y


def make_model(dtype: torch.dtype = torch.float32, seed: int = 0) -> Adversarial:
    torch.manual_seed(seed)
    return Adversarial(dtype)


def loss_fn(model: nn.Module, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    return torch.nn.functional.mse_loss(model(x).float(), y.float())


def flat_params(model: nn.Module) -> torch.Tensor:
    return torch.cat([p.detach().reshape(-1).double() for p in model.parameters()])


def parity_gpt() -> GPT:
    """:data:`PARITY_GPT` in float64, the same weights in every process."""
    torch.manual_seed(0)
    return GPT(PARITY_GPT).double()


def token_batch(rank: int, step: int) -> tuple[torch.Tensor, torch.Tensor]:
    """3 x 16 tokens and targets for :data:`PARITY_GPT`, different on every data rank and step."""
    g = torch.Generator().manual_seed(1000 * step + rank)
    shape = (3, 16)
    return (
        torch.randint(0, PARITY_GPT.vocab_size, shape, generator=g),
        torch.randint(0, PARITY_GPT.vocab_size, shape, generator=g),
    )

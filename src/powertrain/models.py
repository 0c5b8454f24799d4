"""A small nanoGPT-style decoder-only transformer (pre-norm, causal self-attention, GELU MLP)."""

from __future__ import annotations

import dataclasses

import torch
import torch.nn.functional as F
from torch import nn

from powertrain._checks import check_int


@dataclasses.dataclass(frozen=True)
class GPTConfig:
    vocab_size: int = 256  # bytes
    block_size: int = 128
    n_layer: int = 4
    n_head: int = 4
    d_model: int = 128

    def __post_init__(self) -> None:
        for name in ("vocab_size", "block_size", "n_layer", "n_head", "d_model"):
            check_int(f"GPTConfig.{name}", getattr(self, name), 1)
        if self.d_model % self.n_head:
            raise ValueError(f"GPTConfig.d_model={self.d_model} must be divisible by n_head={self.n_head}")


class Block(nn.Module):
    def __init__(self, cfg: GPTConfig) -> None:
        super().__init__()
        self.n_head = cfg.n_head
        self.ln1 = nn.LayerNorm(cfg.d_model)
        self.qkv = nn.Linear(cfg.d_model, 3 * cfg.d_model)
        self.proj = nn.Linear(cfg.d_model, cfg.d_model)
        self.ln2 = nn.LayerNorm(cfg.d_model)
        self.fc = nn.Linear(cfg.d_model, 4 * cfg.d_model)
        self.fc_out = nn.Linear(4 * cfg.d_model, cfg.d_model)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, d = x.shape
        qkv = self.qkv(self.ln1(x))
        # sizes from qkv, not d and n_head: under tensor parallelism (powertrain.tp) a rank holds n_head / tp heads
        q, k, v = qkv.split(qkv.shape[-1] // 3, dim=2)
        q, k, v = (z.view(b, t, -1, d // self.n_head).transpose(1, 2) for z in (q, k, v))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.proj(y.transpose(1, 2).reshape(b, t, -1))
        return x + self.fc_out(F.gelu(self.fc(self.ln2(x))))


class GPT(nn.Module):
    def __init__(self, cfg: GPTConfig) -> None:
        super().__init__()
        self.cfg = cfg
        self.tok = nn.Embedding(cfg.vocab_size, cfg.d_model)
        self.pos = nn.Embedding(cfg.block_size, cfg.d_model)
        self.blocks = nn.ModuleList(Block(cfg) for _ in range(cfg.n_layer))
        self.ln_f = nn.LayerNorm(cfg.d_model)
        self.head = nn.Linear(cfg.d_model, cfg.vocab_size, bias=False)
        self.apply(self._init)

    @staticmethod
    def _init(m: nn.Module) -> None:
        if isinstance(m, nn.Linear | nn.Embedding):
            nn.init.normal_(m.weight, std=0.02)
        if isinstance(m, nn.Linear) and m.bias is not None:
            nn.init.zeros_(m.bias)

    def forward(self, idx: torch.Tensor, targets: torch.Tensor | None = None) -> torch.Tensor:
        """Logits ``(b, t, vocab)``, or the mean cross-entropy if ``targets`` are given."""
        t = idx.shape[1]
        if t > self.cfg.block_size:
            raise ValueError(f"sequence length {t} exceeds block_size={self.cfg.block_size}")
        x = self.tok(idx) + self.pos(torch.arange(t, device=idx.device))
        for block in self.blocks:
            x = block(x)
        logits = self.head(self.ln_f(x))
        if targets is None:
            return logits
        return F.cross_entropy(logits.view(-1, logits.shape[-1]).float(), targets.reshape(-1))

    def num_params(self) -> int:
        return sum(p.numel() for p in self.parameters())


class _ResBlock1d(nn.Module):
    def __init__(self, channels: int) -> None:
        super().__init__()
        self.conv1 = nn.Conv1d(channels, channels, 3, padding=1)
        self.norm1 = nn.GroupNorm(4, channels)
        self.conv2 = nn.Conv1d(channels, channels, 3, padding=1)
        self.norm2 = nn.GroupNorm(4, channels)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = F.relu(self.norm1(self.conv1(x)))
        return F.relu(x + self.norm2(self.conv2(h)))


#: The 1-D ResNet's channels (its convolutions' smaller side), as ``powertrain train`` builds it.
RESNET_WIDTH = 64


class ResNet1d(nn.Module):
    """A small ResNet for 1-D signals (mnist1d: 1 channel, length 40, 10 classes). GroupNorm, not BatchNorm:
    no running statistics that ranks would have to keep in sync."""

    def __init__(self, in_channels: int = 1, num_classes: int = 10, width: int = RESNET_WIDTH, blocks: int = 3) -> None:
        super().__init__()
        self.stem = nn.Conv1d(in_channels, width, 5, padding=2)
        self.blocks = nn.Sequential(*(_ResBlock1d(width) for _ in range(blocks)))
        self.head = nn.Linear(width, num_classes)

    def forward(self, x: torch.Tensor, targets: torch.Tensor | None = None) -> torch.Tensor:
        h = self.blocks(F.relu(self.stem(x))).mean(dim=2)
        logits = self.head(h)
        return logits if targets is None else F.cross_entropy(logits.float(), targets)

    def num_params(self) -> int:
        return sum(p.numel() for p in self.parameters())

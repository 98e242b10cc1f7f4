"""int8 sync payloads: per-block scales and error feedback (`--sync-dtype int8`).

A payload y is cut into blocks of BLOCK values; each block travels as q = round(y / s) in int8 with its float32
scale s = max|y| / 127 (s = 1 for a block of zeros), and stands for q s. Each rank keeps the residual e of its own
casts and adds it to the next payload: y = x + e, e ← y − q s (error feedback, EF-SGD: Karimireddy, Rebjock, Stich
and Jaggi, ICML 2019, Algorithm 2, p = γg + e, Δ = C(p), e ← p − Δ; 1-bit SGD, Seide et al., Interspeech 2014,
feeds its quantisation error back the same way). The sum each rank computes for the chunk it owns in the ring is
cast the same way, with a residual of its own (DoubleSqueeze, Tang et al., ICML 2019: error feedback on both the
workers' payloads and the compressed sum).
"""

from __future__ import annotations

import torch

BLOCK = 256
"""Values per scale."""


def quantise(y: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Return (q, s): `y` (a multiple of BLOCK values) as int8 blocks and their scales."""
    blocks = y.view(-1, BLOCK)
    scales = blocks.abs().amax(1) / 127
    scales = torch.where(scales > 0, scales, torch.ones_like(scales))
    return torch.round(blocks / scales[:, None]).clamp_(-127, 127).to(torch.int8).view(-1), scales


def dequantise(q: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """Return the float32 values int8 blocks `q` with `scales` stand for."""
    return (q.view(-1, BLOCK).float() * scales[:, None]).view(-1)


def wire_bytes(n: int) -> int:
    """Bytes of n values on the wire: one byte each and a float32 scale per block."""
    return n + 4 * -(-n // BLOCK)


class Feedback:
    """This rank's residuals: of its payloads and of the sums of the chunk it owns."""

    def __init__(self) -> None:
        self.residuals: dict[str, torch.Tensor] = {}

    def cast(self, name: str, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Quantise x plus the residual `name` (zeros at first, or after the payload's size changed); keep the
        new residual."""
        residual = self.residuals.get(name)
        if residual is None or residual.shape != x.shape:
            residual = self.residuals[name] = torch.zeros_like(x)
        y = x + residual
        q, scales = quantise(y)
        torch.sub(y, dequantise(q, scales), out=residual)
        return q, scales

    def state_dict(self) -> dict[str, torch.Tensor]:
        return dict(self.residuals)

    def load_state_dict(self, state: dict[str, torch.Tensor]) -> None:
        self.residuals = {name: residual.float().clone() for name, residual in state.items()}

"""Fidelity metrics between an uncompressed and a compressed pass over the same tokens."""

from __future__ import annotations

from dataclasses import dataclass

import torch

__all__ = ["Tally", "compare_logits"]


@dataclass
class Tally:
    """Running sums over positions: KL (nats), top-1 matches, NLL of the next token (nats)."""

    kl: float = 0.0
    top1: int = 0
    nll: float = 0.0
    positions: int = 0
    nll_positions: int = 0

    def add(self, other: Tally) -> None:
        self.kl += other.kl
        self.top1 += other.top1
        self.nll += other.nll
        self.positions += other.positions
        self.nll_positions += other.nll_positions

    @property
    def mean_kl(self) -> float:
        return self.kl / max(self.positions, 1)

    @property
    def top1_agree(self) -> float:
        return self.top1 / max(self.positions, 1)

    @property
    def ppl(self) -> float:
        return float(torch.tensor(self.nll / max(self.nll_positions, 1)).exp())


def compare_logits(base: torch.Tensor, other: torch.Tensor, targets: torch.Tensor | None = None,
                   base_logp: torch.Tensor | None = None) -> Tally:
    """KL(P_base ‖ P_other) summed over positions, top-1 agreement, and ``other``'s NLL.

    Args:
        base, other: float logits ``(T, vocab)``. targets: int64 ``(T,)`` next tokens
            (position t predicts targets[t]); entries < 0 are skipped. base_logp: cached
            ``log_softmax(base)``.
    """
    lb = torch.log_softmax(base.float(), -1) if base_logp is None else base_logp
    lo = torch.log_softmax(other.float(), -1)
    kl = (lb.exp() * (lb - lo)).sum(-1).clamp_min(0)
    t = Tally(float(kl.sum()), int((base.argmax(-1) == other.argmax(-1)).sum()), 0.0, int(kl.numel()))
    if targets is not None:
        ok = targets >= 0
        t.nll = float(-lo[ok].gather(-1, targets[ok].unsqueeze(-1)).sum())
        t.nll_positions = int(ok.sum())
    return t

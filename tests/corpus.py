"""Models nobody on the team wrote the expectations for: the shapes users bring (frozen parameters, buffers, unused
and shared parameters, biased odd-sized layers), as factories a cell names with ``model._target_=corpus.<name>``
(the tests' directory is on the ranks' path)."""

from __future__ import annotations

import torch
from torch import nn


def frozen_mlp(width: int = 16, depth: int = 4, frozen: tuple[int, ...] = (0,)) -> nn.Module:
    """``depth`` bias-free Linear layers, those at the indices ``frozen`` with ``requires_grad=False``."""
    model = nn.Sequential(*(nn.Linear(width, width, bias=False) for _ in range(depth)))
    for i in frozen:
        model[i].weight.requires_grad_(False)
    return model


def biased(sizes: tuple[int, ...] = (10, 7, 3)) -> nn.Module:
    """Linear layers with biases between odd sizes (10 -> 7 -> 3)."""
    return nn.Sequential(*(nn.Linear(a, b) for a, b in zip(sizes, sizes[1:])))


class ConvBN(nn.Sequential):
    """A small convnet with BatchNorm: running statistics and a batch counter as buffers."""

    def __init__(self, channels: int = 4) -> None:
        super().__init__(nn.Conv2d(3, channels, 3, padding=1, bias=False), nn.BatchNorm2d(channels), nn.ReLU(),
                         nn.Conv2d(channels, channels, 3, padding=1, bias=False), nn.BatchNorm2d(channels),
                         nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(channels, 5))


def conv_bn(channels: int = 4) -> nn.Module:
    return ConvBN(channels)


class UnusedBranch(nn.Module):
    """Two Linear layers forward uses and one it never calls."""

    def __init__(self, width: int = 8) -> None:
        super().__init__()
        self.a, self.unused, self.b = (nn.Linear(width, width, bias=False) for _ in range(3))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.b(self.a(x))


def unused_branch(width: int = 8) -> nn.Module:
    return UnusedBranch(width)


class AppliedTwice(nn.Module):
    """One Linear applied twice in a forward, between two others (shared weights)."""

    def __init__(self, width: int = 8) -> None:
        super().__init__()
        self.first, self.shared, self.last = (nn.Linear(width, width, bias=False) for _ in range(3))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.last(self.shared(torch.relu(self.shared(self.first(x)))))


def applied_twice(width: int = 8) -> nn.Module:
    return AppliedTwice(width)


class PositiveOnly(nn.Module):
    """Keeps the hidden features whose batch sum is positive (``nonzero``): a shape that depends on the values, which
    a step on fake tensors cannot have (the planner's traces), a real one can."""

    def __init__(self, width: int = 8) -> None:
        super().__init__()
        self.a, self.b = nn.Linear(width, width), nn.Linear(width, width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.a(x)
        kept = h.index_select(1, torch.nonzero(h.sum(0) > 0).flatten())
        return self.b(h + kept.sum(1, keepdim=True))


def positive_only(width: int = 8) -> nn.Module:
    return PositiveOnly(width)

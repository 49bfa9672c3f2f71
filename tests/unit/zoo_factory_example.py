"""A model factory for resolve_model's ``package.module:factory`` spec (used by test_zoo.py)."""

import torch
import torch.nn as nn


def tiny_mlp(batch: int = 1):
    """(model, example inputs) for a two-layer MLP on `batch` rows."""
    model = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 4)).eval()
    return model, (torch.randn(batch, 8, generator=torch.Generator().manual_seed(0)),)


def fixed_size():
    """A factory that takes no batch argument; returns a single tensor rather than a tuple of inputs."""
    return nn.Tanh(), torch.ones(3)


def not_a_pair():
    return nn.Tanh()

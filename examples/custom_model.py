"""A user-defined model for autopar: ``autopar plan examples/custom_model.py:make``.

Any file works the same way: define a function that returns
``(model, example_inputs)`` and name it after the colon. It may also return a
``loss_fn(output, target)`` and an ``example_target`` as third and fourth
elements, to plan for training.
"""
import torch
import torch.nn as nn


class ResidualBlock(nn.Module):
    def __init__(self, dim: int):
        super().__init__()
        self.norm = nn.LayerNorm(dim)
        self.fc1 = nn.Linear(dim, 4 * dim)
        self.fc2 = nn.Linear(4 * dim, dim)

    def forward(self, x):
        return x + self.fc2(torch.relu(self.fc1(self.norm(x))))


class ResidualMLP(nn.Module):
    def __init__(self, dim: int = 64, layers: int = 2, classes: int = 10):
        super().__init__()
        self.blocks = nn.ModuleList([ResidualBlock(dim) for _ in range(layers)])
        self.head = nn.Linear(dim, classes)

    def forward(self, x):
        for block in self.blocks:
            x = block(x)
        return self.head(x)


def make():
    """Return ``(model, (x,))``: a 2-layer residual MLP and a batch of 8 inputs."""
    torch.manual_seed(0)
    model = ResidualMLP()
    x = torch.randn(8, 64)
    return model, (x,)

"""JAX code inside a PyTorch training loop: torchjax.to_torch, trained with torch.optim.

The model is a learnable random-Fourier-feature layer written in JAX, followed by a torch
nn.Linear; the loss (log-cosh) is also written in JAX. `to_torch` makes both ordinary torch
functions: torch autograd calls `jax.vjp` for their backward, so `loss.backward()` and
`torch.optim.Adam` work unchanged, and the layer's weights are plain nn.Parameters.

The reference trains the same model, from the same initial weights, with both pieces
written in torch; the loss trajectories and final weights agree to float32 rounding.

Run: python examples/jax_in_torch_training.py
"""

import math

import jax.numpy as jnp
import numpy as np
import torch

import torchjax

STEPS, LR, FEATURES = 60, 1e-2, 16


@torchjax.to_torch
def fourier_features_jax(params, x):  # {'w': [2, F], 'b': [F]}, [N, 2] -> [N, F]
    return jnp.sin(x @ params["w"] + params["b"])


@torchjax.to_torch
def log_cosh_loss_jax(pred, target):  # [N, 1], [N, 1] -> []
    r = pred - target
    return jnp.mean(jnp.logaddexp(r, -r) - jnp.log(2.0))


def fourier_features_torch(params, x):  # the same two functions in torch, for the reference
    return torch.sin(x @ params["w"] + params["b"])


def log_cosh_loss_torch(pred, target):
    r = pred - target
    return torch.mean(torch.logaddexp(r, -r) - math.log(2.0))


class Model(torch.nn.Module):
    def __init__(self, features):
        super().__init__()
        self.features = features
        self.w = torch.nn.Parameter(torch.randn(2, FEATURES))
        self.b = torch.nn.Parameter(2 * math.pi * torch.rand(FEATURES))
        self.head = torch.nn.Linear(FEATURES, 1)

    def forward(self, x):  # [N, 2] -> [N, 1]
        return self.head(self.features({"w": self.w, "b": self.b}, x))


def train(features, loss_fn):
    torch.manual_seed(0)  # same data and initial weights for both runs
    x = 4 * torch.rand(128, 2) - 2
    y = torch.sin(2 * x[:, :1]) * torch.cos(x[:, 1:])  # [128, 1]
    model = Model(features)
    optimizer = torch.optim.Adam(model.parameters(), lr=LR)
    losses = []
    for _ in range(STEPS):
        optimizer.zero_grad()
        loss = loss_fn(model(x), y)
        loss.backward()  # through jax.vjp where the pieces are JAX
        optimizer.step()
        losses.append(loss.item())
    return losses, model


jax_losses, jax_model = train(fourier_features_jax, log_cosh_loss_jax)
torch_losses, torch_model = train(fourier_features_torch, log_cosh_loss_torch)

for i in range(0, STEPS, 12):
    print(f"step {i:2d}  JAX pieces {jax_losses[i]:.6f}   torch pieces {torch_losses[i]:.6f}")
diff = float(np.max(np.abs(np.subtract(jax_losses, torch_losses))))
print(
    f"loss {jax_losses[0]:.4f} -> {jax_losses[-1]:.4f}; max |difference| of trajectories {diff:.2e}"
)

np.testing.assert_allclose(jax_losses, torch_losses, rtol=1e-4, atol=1e-6)
for (name, p), q in zip(jax_model.named_parameters(), torch_model.parameters(), strict=True):
    np.testing.assert_allclose(p.detach(), q.detach(), rtol=1e-4, atol=1e-5, err_msg=name)
assert jax_losses[-1] < 0.5 * jax_losses[0], jax_losses  # and it did learn
print("trajectories and final weights agree with the all-torch model")

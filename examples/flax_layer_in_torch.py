"""A flax layer inside a torch model, trained with torch.optim: `to_torch_module`.

`to_torch_module(fn, params)` turns a JAX function of a params pytree into an nn.Module
whose parameters are torch-owned copies of `params` (named after the tree paths:
`kernel`, `bias`). Here the JAX part is a flax `linen.Dense` layer between two torch layers,
and the whole model trains with `torch.optim.Adam` and `loss.backward()`.

Checks: the loss trajectory and final weights equal those of the same model written wholly
in torch (nn.Linear with the flax layer's initial weights, transposed); the loss drops; the
original JAX params are unchanged (the module trained its own copies).

Run: python examples/flax_layer_in_torch.py
"""

import flax.linen as nn
import jax
import numpy as np
import torch

import torchjax

STEPS, LR = 40, 1e-2

dense = nn.Dense(8)
jax_params = dense.init(jax.random.key(0), np.zeros((1, 16), np.float32))["params"]
jax_params_before = jax.tree.map(np.array, jax_params)  # numpy copies, to compare at the end


def make_model(middle):
    torch.manual_seed(0)  # same torch layers in both models
    return torch.nn.Sequential(
        torch.nn.Linear(2, 16), torch.nn.Tanh(), middle, torch.nn.Tanh(), torch.nn.Linear(8, 1)
    )


flax_layer = torchjax.to_torch_module(lambda p, x: dense.apply({"params": p}, x), jax_params)
print("flax layer's torch parameters:", sorted(flax_layer.state_dict()))

torch_layer = torch.nn.Linear(16, 8)  # the reference: the same layer written in torch
with torch.no_grad():
    torch_layer.weight.copy_(torch.tensor(np.array(jax_params["kernel"]).T))
    torch_layer.bias.copy_(torch.tensor(np.array(jax_params["bias"])))


def train(model):
    g = torch.Generator().manual_seed(1)
    x = 4 * torch.rand(128, 2, generator=g) - 2
    y = torch.sin(x[:, :1]) * x[:, 1:]  # [128, 1]
    optimizer = torch.optim.Adam(model.parameters(), lr=LR)
    losses = []
    for _ in range(STEPS):
        optimizer.zero_grad()
        loss = torch.nn.functional.mse_loss(model(x), y)
        loss.backward()  # through jax.vjp inside the flax layer
        optimizer.step()
        losses.append(loss.item())
    return losses


with_flax, all_torch = make_model(flax_layer), make_model(torch_layer)
losses, losses_ref = train(with_flax), train(all_torch)
print("loss", " -> ".join(f"{v:.4f}" for v in losses[::10]), f"-> {losses[-1]:.4f}")
np.testing.assert_allclose(losses, losses_ref, rtol=1e-4, atol=1e-6)
np.testing.assert_allclose(
    flax_layer.kernel.detach().numpy(), torch_layer.weight.detach().numpy().T, rtol=1e-4, atol=1e-5
)
assert losses[-1] < 0.5 * losses[0], losses
print("trajectory and trained weights equal the all-torch model's")

changed = jax.tree.map(
    lambda a, b: not np.array_equal(np.asarray(a), b), jax_params, jax_params_before
)
assert not any(jax.tree.leaves(changed)), changed
assert not np.allclose(flax_layer.kernel.detach().numpy(), jax_params_before["kernel"])
print("the JAX params are unchanged: the module trained its own copies")

"""Train a torch.nn.Module with optax: the torch model is a pure JAX function of its params.

The same model, data and initial weights are trained twice — with optax.adam through
torchjax, and with torch.optim.Adam in plain PyTorch — and the loss trajectories agree.
"""

import copy

import jax
import jax.numpy as jnp
import numpy as np
import optax
import torch

import torchjax

STEPS, LR = 60, 1e-2


def make_model_and_data(seed: int = 0):
    torch.manual_seed(seed)
    model = torch.nn.Sequential(torch.nn.Linear(3, 32), torch.nn.Tanh(), torch.nn.Linear(32, 1))
    x = torch.linspace(-2, 2, 64 * 3).reshape(64, 3)
    y = torch.sin(x).sum(dim=1, keepdim=True)  # a smooth synthetic target: [64, 3] -> [64, 1]
    return model, x, y


def train_with_optax(steps: int = STEPS) -> list[float]:
    model, x_t, y_t = make_model_and_data()
    apply, variables = torchjax.module_to_jax(model)
    x, y = torchjax.tree_to_jax((x_t, y_t))
    params, buffers = variables["params"], variables["buffers"]

    def loss_fn(params):
        pred = apply({"params": params, "buffers": buffers}, x)
        return jnp.mean((pred - y) ** 2)

    optimizer = optax.adam(LR)
    opt_state = optimizer.init(params)

    @jax.jit
    def step(params, opt_state):
        loss, grads = jax.value_and_grad(loss_fn)(params)
        updates, opt_state = optimizer.update(grads, opt_state)
        return optax.apply_updates(params, updates), opt_state, loss

    losses = []
    for _ in range(steps):
        params, opt_state, loss = step(params, opt_state)
        losses.append(float(loss))
    return losses


def train_with_torch(steps: int = STEPS) -> list[float]:
    model, x, y = make_model_and_data()
    model = copy.deepcopy(model)
    optimizer = torch.optim.Adam(model.parameters(), lr=LR)
    losses = []
    for _ in range(steps):
        optimizer.zero_grad()
        loss = torch.mean((model(x) - y) ** 2)
        loss.backward()
        optimizer.step()
        losses.append(loss.item())
    return losses


if __name__ == "__main__":
    jax_losses, torch_losses = train_with_optax(), train_with_torch()
    for i in range(0, STEPS, 10):
        print(
            f"step {i:3d}  optax+torchjax {jax_losses[i]:.6f}   torch.optim {torch_losses[i]:.6f}"
        )
    print("max |difference|:", float(np.max(np.abs(np.subtract(jax_losses, torch_losses)))))

"""A flax model with a torch submodule, trained jointly with optax.

The model is a flax `linen.Dense` layer followed by a torch block (Linear -> GELU -> Linear)
wrapped with `module_to_jax`. Both parameter sets live in one pytree,
`{"flax": ..., "torch": ...}`, so one `jax.grad` and one `optax.adam` update train both.

Checks: the gradient w.r.t. both parts equals the gradient of the same model with the torch
block re-implemented in jax.numpy, and a few jitted steps lower the loss.

Run: python examples/flax_with_torch_layer.py
"""

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
import torch

import torchjax

STEPS = 30

torch.manual_seed(0)
torch_block = torch.nn.Sequential(torch.nn.Linear(16, 16), torch.nn.GELU(), torch.nn.Linear(16, 1))
torch_apply, torch_variables = torchjax.module_to_jax(torch_block)
dense = nn.Dense(16)

key_x, key_init = jax.random.split(jax.random.key(0))
x = jax.random.normal(key_x, (64, 3))  # [N, 3]
y = jnp.sin(x[:, :1]) * jnp.cos(x[:, 1:2]) + 0.5 * x[:, 2:]  # [N, 1]
params = {"flax": dense.init(key_init, x)["params"], "torch": torch_variables["params"]}


def torch_part(p, h):  # the torch block, through torchjax
    return torch_apply({"params": p, "buffers": torch_variables["buffers"]}, h)


def jnp_part(p, h):  # the same block in jax.numpy: the independent reference
    h = jax.nn.gelu(h @ p["0.weight"].T + p["0.bias"], approximate=False)
    return h @ p["2.weight"].T + p["2.bias"]


def make_loss(block):
    def loss(params, x, y):  # [N, 3] -> [N, 16] (flax) -> [N, 1] (torch)
        h = jnp.tanh(dense.apply({"params": params["flax"]}, x))
        return jnp.mean((block(params["torch"], h) - y) ** 2)

    return loss


loss, loss_ref = make_loss(torch_part), make_loss(jnp_part)
value, grads = jax.jit(jax.value_and_grad(loss))(params, x, y)
value_ref, grads_ref = jax.value_and_grad(loss_ref)(params, x, y)
np.testing.assert_allclose(value, value_ref, rtol=1e-5)
flat, flat_ref = jax.tree.leaves_with_path(grads), jax.tree.leaves(grads_ref)
for (path, g), g_ref in zip(flat, flat_ref, strict=True):
    np.testing.assert_allclose(g, g_ref, rtol=1e-4, atol=1e-6, err_msg=jax.tree_util.keystr(path))
print(f"gradient of all {len(flat)} leaves (flax and torch) matches the jax.numpy model")

optimizer = optax.adam(1e-2)


@jax.jit
def step(params, opt_state):
    value, grads = jax.value_and_grad(loss)(params, x, y)
    updates, opt_state = optimizer.update(grads, opt_state, params)
    return optax.apply_updates(params, updates), opt_state, value


opt_state = optimizer.init(params)
losses = []
for _ in range(STEPS):
    params, opt_state, value = step(params, opt_state)
    losses.append(float(value))
final = float(loss_ref(params, x, y))  # the trained params, evaluated without torch
print("loss", " -> ".join(f"{v:.4f}" for v in losses[::10]), f"-> {final:.4f}")
assert final < 0.5 * losses[0], (losses, final)
print("flax and torch parameters trained jointly with one optax optimizer")

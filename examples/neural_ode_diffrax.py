"""A neural ODE whose vector field is a torch nn.Module, solved and differentiated in JAX.

    dy/dt = f_theta(y),   f_theta = torch MLP, [B, 2] -> [B, 2]

`module_to_jax` makes the MLP a pure function of its parameters; diffrax solves the ODE with
Tsit5, and `jax.grad` differentiates the solution w.r.t. the torch parameters (diffrax
backpropagates through the solver steps; each vector-field evaluation's vjp runs in torch).

Checks: the loss and its gradient equal those of the same ODE with the MLP written in
jax.numpy (same weights), and a few optax steps fit the torch field to a damped spiral.

Run: python examples/neural_ode_diffrax.py
"""

import diffrax
import jax
import jax.numpy as jnp
import numpy as np
import optax
import torch

import torchjax

torch.manual_seed(0)
mlp = torch.nn.Sequential(torch.nn.Linear(2, 32), torch.nn.Tanh(), torch.nn.Linear(32, 2))
apply, variables = torchjax.module_to_jax(mlp)
buffers = variables["buffers"]  # empty for this MLP

TS = np.linspace(0.0, 2.0, 9, dtype=np.float32)  # observation times, every 0.25
# Four initial conditions solved as one [4, 2] state: nn.Linear handles the batch axis, so
# each vector-field evaluation is a single torch call for all four trajectories.
Y0 = np.array([[1.0, 0.0], [0.0, 1.0], [-0.7, 0.5], [0.3, -0.9]], dtype=np.float32)

# Training data: the damped spiral dy/dt = [[-0.1, 1], [-1, -0.1]] y, solved exactly:
# y(t) = exp(-0.1 t) * (rotation of y0 by angle -t).
c, s = np.cos(TS)[:, None], np.sin(TS)[:, None]  # [9, 1]
rotated = np.stack([c * Y0[:, 0] + s * Y0[:, 1], c * Y0[:, 1] - s * Y0[:, 0]], axis=-1)
TARGET = np.exp(-0.1 * TS)[:, None, None] * rotated  # [9, 4, 2]


def make_loss(vector_field):
    """Mean squared distance of the solution to TARGET, as a function of the MLP's params."""
    term = diffrax.ODETerm(lambda t, y, params: vector_field(params, y))

    def loss(params):
        sol = diffrax.diffeqsolve(
            term,
            diffrax.Tsit5(),
            t0=TS[0],
            t1=TS[-1],
            dt0=0.25,  # fixed steps keep the run short and the two versions step-for-step equal
            y0=Y0,
            args=params,
            saveat=diffrax.SaveAt(ts=TS),
            stepsize_controller=diffrax.ConstantStepSize(),
        )
        return jnp.mean((sol.ys - TARGET) ** 2)  # ys: [9, 4, 2]

    return loss


def torch_field(params, y):  # the torch MLP, through torchjax
    return apply({"params": params, "buffers": buffers}, y)


def jnp_field(params, y):  # the same MLP in jax.numpy: the independent reference
    h = jnp.tanh(y @ params["0.weight"].T + params["0.bias"])
    return h @ params["2.weight"].T + params["2.bias"]


loss_and_grad = jax.jit(jax.value_and_grad(make_loss(torch_field)))
loss_and_grad_ref = jax.jit(jax.value_and_grad(make_loss(jnp_field)))

# 1. The gradient through diffrax + torch equals the pure-JAX one.
params = variables["params"]
value, grads = loss_and_grad(params)
value_ref, grads_ref = loss_and_grad_ref(params)
print(f"loss: torch field {float(value):.6f}   jax.numpy field {float(value_ref):.6f}")
np.testing.assert_allclose(value, value_ref, rtol=1e-5)
for name in grads:
    np.testing.assert_allclose(grads[name], grads_ref[name], rtol=1e-4, atol=1e-6)
worst = max(float(jnp.max(jnp.abs(grads[k] - grads_ref[k]))) for k in grads)
print(f"d loss / d params matches the jax.numpy ODE; max |diff| {worst:.2e}")

# 2. Fit the torch vector field to the spiral with optax (reusing the compiled gradient).
optimizer = optax.adam(1e-2)
update = jax.jit(optimizer.update)
opt_state = optimizer.init(params)
losses = []
for _ in range(12):
    loss, grads = loss_and_grad(params)
    updates, opt_state = update(grads, opt_state)
    params = optax.apply_updates(params, updates)
    losses.append(float(loss))
final = float(loss_and_grad_ref(params)[0])  # the fitted weights, evaluated in jax.numpy
print("fit: loss", " -> ".join(f"{x:.4f}" for x in losses[::3]), f"-> {final:.4f}")
assert final < 0.25 * losses[0], (losses, final)

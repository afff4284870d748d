"""A torch vector field in diffrax, differentiated with both adjoints.

    dy/dt = f_theta(y),   f_theta = torch MLP (module_to_jax), [B, 2] -> [B, 2]

`RecursiveCheckpointAdjoint` (diffrax's default) backpropagates through the solver's steps;
`BacksolveAdjoint` solves the adjoint ODE backwards in time, calling `jax.vjp` of the
vector field at each of its steps. Through torchjax, both end in torch's autograd.

Checks: for each adjoint, the gradient w.r.t. the MLP's parameters equals the one with the
MLP written in jax.numpy (same weights, same adjoint); and the two adjoints agree with each
other up to the backward solve's discretisation error.

Run: python examples/neural_ode_adjoints.py
"""

import diffrax
import jax
import jax.numpy as jnp
import numpy as np
import torch

import torchjax

torch.manual_seed(0)
mlp = torch.nn.Sequential(torch.nn.Linear(2, 16), torch.nn.Tanh(), torch.nn.Linear(16, 2))
apply, variables = torchjax.module_to_jax(mlp)
params = variables["params"]
Y0 = jnp.array([[1.0, 0.0], [0.0, 1.0]], dtype=jnp.float32)  # two trajectories, one state


def torch_field(t, y, params):  # the torch MLP, through torchjax
    return apply({"params": params, "buffers": variables["buffers"]}, y)


def jnp_field(t, y, params):  # the same MLP in jax.numpy: the independent reference
    h = jnp.tanh(y @ params["0.weight"].T + params["0.bias"])
    return h @ params["2.weight"].T + params["2.bias"]


def make_loss(field, adjoint):
    def loss(params):
        sol = diffrax.diffeqsolve(
            diffrax.ODETerm(field),
            diffrax.Tsit5(),
            t0=0.0,
            t1=1.0,
            dt0=0.05,
            y0=Y0,
            args=params,
            adjoint=adjoint,
            stepsize_controller=diffrax.ConstantStepSize(),
        )
        return jnp.sum(sol.ys[-1] ** 2)  # ys: [1, 2, 2], the state at t1

    return loss


def gradients(adjoint):
    """Loss and gradient with the torch field, checked against the jax.numpy field."""
    name = type(adjoint).__name__
    value, g = jax.jit(jax.value_and_grad(make_loss(torch_field, adjoint)))(params)
    value_ref, g_ref = jax.jit(jax.value_and_grad(make_loss(jnp_field, adjoint)))(params)
    np.testing.assert_allclose(value, value_ref, rtol=1e-5)
    for k in g:
        np.testing.assert_allclose(g[k], g_ref[k], rtol=1e-4, atol=1e-6, err_msg=f"{name} {k}")
    print(f"{name:26s} loss {float(value):.6f}: gradient matches the jax.numpy field")
    return g


recursive = gradients(diffrax.RecursiveCheckpointAdjoint())
assert max(float(jnp.max(jnp.abs(g))) for g in recursive.values()) > 1e-3  # worth comparing

# BacksolveAdjoint takes jax.jacfwd of a function that calls the vector field's vjp with
# respect to its cotangent: the one torch call for a VJP and its tangent splits again there.
backsolve = gradients(diffrax.BacksolveAdjoint())
worst = max(
    float(jnp.max(jnp.abs(recursive[k] - backsolve[k])) / jnp.max(jnp.abs(recursive[k])))
    for k in recursive
)
print(f"the two adjoints agree: max relative difference {worst:.1e}")
assert worst < 1e-3, worst

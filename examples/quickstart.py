"""Quickstart: a torch function used as a JAX function — eager, jit, vmap, grad, jvp, hessian.

Run with `make demo`.
"""

import jax
import jax.numpy as jnp
import numpy as np
import torch

import torchjax

# 1. Zero-copy conversion of whole pytrees.
params_torch = {
    "w": torch.randn(3, 2, generator=torch.Generator().manual_seed(0)),
    "b": torch.zeros(2),
}
params = torchjax.tree_to_jax(params_torch)  # {'w': [3, 2], 'b': [2]} as jax.Array
print(
    "tree_to_jax shares memory:",
    params["w"].unsafe_buffer_pointer() == params_torch["w"].data_ptr(),
)


# 2. A torch function taking a dict of tensors, wrapped for JAX.
@torchjax.to_jax
def layer(p, x):
    """tanh(x @ w + b) written in torch: {'w': [3, 2], 'b': [2]}, [3] -> [2]."""
    return torch.tanh(x @ p["w"] + p["b"])


def layer_jnp(p, x):  # the same math in jax.numpy, as a reference
    return jnp.tanh(x @ p["w"] + p["b"])


x = jnp.array([0.5, -0.4, 0.3])
print("eager          :", layer(params, x))
print("jit            :", jax.jit(layer)(params, x))

# 3. vmap over a batch: ONE torch.func.vmap call, not a Python loop.
xs = jnp.linspace(-1, 1, 12).reshape(4, 3)
print("vmap           :", jax.vmap(layer, in_axes=(None, 0))(params, xs).shape)


# 4. Gradients through torch with every JAX autodiff transform.
def loss(p, x):
    return jnp.sum(layer(p, x) ** 2)


g = jax.jit(jax.grad(loss))(params, x)
g_ref = jax.grad(lambda p, x: jnp.sum(layer_jnp(p, x) ** 2))(params, x)
print("grad matches jax.numpy:", all(np.allclose(g[k], g_ref[k], rtol=1e-4, atol=1e-6) for k in g))

_, tangent = jax.jvp(lambda x: layer(params, x), (x,), (jnp.ones(3),))
print("jvp            :", tangent)

hess = jax.hessian(lambda x: jnp.sum(layer(params, x) ** 2))(x)
hess_ref = jax.hessian(lambda x: jnp.sum(layer_jnp(params, x) ** 2))(x)
print("hessian matches jax.numpy:", np.allclose(hess, hess_ref, atol=1e-5))

per_example = jax.vmap(jax.grad(loss), in_axes=(None, 0))(params, xs)
print("per-example grads:", {k: v.shape for k, v in per_example.items()})

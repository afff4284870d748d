"""A `torch.compile`d function under jax.jit, jax.grad and jax.vmap.

`to_jax` accepts the compiled function like any torch callable: real calls run the code
torch.compile generated (inductor, the default backend, on first call per shape), and the
JAX transforms compose with it: `jax.grad` runs `torch.func.vjp` of it, `jax.vmap` one
`torch.func.vmap` call over the batch.

Checks: each result equals the same function written in jax.numpy, and torch's compiler did
trace the function (`torch.compiler.is_compiling()` was true inside it).

Run: python examples/torch_compile_in_jax.py
"""

import jax
import jax.numpy as jnp
import numpy as np
import torch

import torchjax

compiled_traces = 0


def features(x, w):  # [N, 4], [4, 3] -> [N]
    global compiled_traces
    if torch.compiler.is_compiling():  # true only while torch.compile traces this function
        compiled_traces += 1
    return torch.sin(torch.tanh(x @ w)).pow(2).sum(-1)


def features_ref(x, w):  # the same function in jax.numpy: the reference
    return jnp.sum(jnp.sin(jnp.tanh(x @ w)) ** 2, axis=-1)


f = torchjax.to_jax(torch.compile(features))

x = jnp.linspace(-1.0, 1.0, 20, dtype=jnp.float32).reshape(5, 4)
w = jnp.linspace(-0.5, 0.7, 12, dtype=jnp.float32).reshape(4, 3)
close = lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6)

close(jax.jit(f)(x, w), features_ref(x, w))
assert compiled_traces >= 1, "the call should have run torch.compile's code"
print(f"jit : matches jax.numpy (torch.compile traced the function {compiled_traces}x)")

loss = lambda f: lambda w: jnp.mean(f(x, w))
close(jax.jit(jax.grad(loss(f)))(w), jax.grad(loss(features_ref))(w))
print("grad: d mean(f) / d w matches jax.numpy")

xs = jnp.stack([x, 2 * x, -x])  # [3, 5, 4]: a batch of inputs, w shared
batched = jax.jit(jax.vmap(f, in_axes=(0, None)))(xs, w)
close(batched, jax.vmap(features_ref, in_axes=(0, None))(xs, w))
print(f"vmap: {batched.shape} batch matches jax.numpy")

per_example = jax.jit(jax.vmap(jax.grad(lambda x, w: f(x, w).sum(), argnums=1), (0, None)))
close(
    per_example(xs, w),
    jax.vmap(jax.grad(lambda x, w: features_ref(x, w).sum(), 1), (0, None))(xs, w),
)
print("vmap(grad): per-example gradients match jax.numpy")

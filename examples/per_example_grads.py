"""Per-example gradients of a torch model's loss: jax.vmap(jax.grad(...)) through module_to_jax.

`jax.grad` of one example's loss gives that example's gradient; `jax.vmap` over the batch
computes all of them in one go (torchjax batches the torch forward and its vjp with
torch.func.vmap, so torch is called once per rule for the whole batch, not once per
example). Used for differential privacy (per-example clipping), influence functions,
gradient-noise statistics.

The reference is plain PyTorch: a loop of `loss.backward()`, one example at a time.

Run: python examples/per_example_grads.py
"""

import jax
import jax.numpy as jnp
import numpy as np
import torch
from torch._subclasses.fake_tensor import is_fake

import torchjax

BATCH = 16

torch.manual_seed(0)
model = torch.nn.Sequential(torch.nn.Linear(4, 32), torch.nn.Tanh(), torch.nn.Linear(32, 1))
x_t = torch.randn(BATCH, 4)
y_t = torch.randn(BATCH, 1)


# Count the model's real forward runs (torchjax also runs it on fake tensors to learn
# shapes; `is_fake` sees through functorch's wrappers) and the batch each one receives.
real_forwards: list[tuple[int, ...]] = []


def _record(module, args):
    t = args[0]
    if not is_fake(t):
        while torch._C._functorch.is_functorch_wrapped_tensor(t):  # vmap / grad wrappers
            t = torch._C._functorch.get_unwrapped(t)
        real_forwards.append(tuple(t.shape))


model.register_forward_pre_hook(_record)

apply, variables = torchjax.module_to_jax(model)
x, y = torchjax.tree_to_jax((x_t, y_t))


def example_loss(params, x, y):
    """Squared error of ONE example: x [4], y [1] -> scalar."""
    pred = apply({"params": params, "buffers": variables["buffers"]}, x)  # [4] -> [1]
    return jnp.sum((pred - y) ** 2)


# [B, 4], [B, 1] -> {name: [B, *param.shape]}
per_example_grads = jax.jit(jax.vmap(jax.grad(example_loss), in_axes=(None, 0, 0)))
grads = per_example_grads(variables["params"], x, y)
for name, g in grads.items():
    print(f"{name:9s} per-example grads {tuple(g.shape)}")
print("real torch forward runs:", len(real_forwards), "each on a batch of shape", real_forwards)
# One forward for the primal and one inside the vjp, each for the whole batch: no loop.
assert real_forwards and all(s == (BATCH, 4) for s in real_forwards), real_forwards
assert len(real_forwards) < BATCH, real_forwards

# Reference: PyTorch autograd, one example at a time.
ref: dict[str, list[torch.Tensor]] = {name: [] for name, _ in model.named_parameters()}
for i in range(BATCH):
    model.zero_grad()
    loss = torch.sum((model(x_t[i]) - y_t[i]) ** 2)
    loss.backward()
    for name, p in model.named_parameters():
        assert p.grad is not None, name
        ref[name].append(p.grad.clone())

worst = 0.0
for name, g in grads.items():
    expected = torch.stack(ref[name]).numpy()
    np.testing.assert_allclose(g, expected, rtol=1e-4, atol=1e-6)
    worst = max(worst, float(np.max(np.abs(np.asarray(g) - expected))))
print(f"matches a torch loop of {BATCH} backward() calls; max |diff|: {worst:.2e}")

# The per-example gradients average to the ordinary batch gradient.
batch_grad = jax.grad(lambda p: jnp.mean(jax.vmap(example_loss, (None, 0, 0))(p, x, y)))(
    variables["params"]
)
for name in grads:
    np.testing.assert_allclose(grads[name].mean(0), batch_grad[name], rtol=1e-4, atol=1e-6)
print("mean of per-example grads == batch grad")

# e.g. DP-SGD style clipping, all in JAX: each example's gradient norm, over all params.
norms = jnp.sqrt(sum(jnp.sum(g.reshape(BATCH, -1) ** 2, axis=1) for g in grads.values()))
print("per-example gradient norms:", np.round(np.asarray(norms), 3))

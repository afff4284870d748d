"""Nested jax.vmap over a torch function that takes a dict, with different in_axes per entry.

The torch function sees one example: {'a': [3], 'b': [6]}. Two vmaps batch it:

* inner: `a` along its axis 0 and `b` along its axis 1 (b's examples are columns);
* outer: `a` along axis 0 again, `b` not at all (`None`: every outer example shares it).

torchjax turns both vmaps into ONE torch call (`torch.func.vmap` nested twice), not
N * M calls. The example counts the real torch calls to show it, and checks the values
against a plain Python loop that calls the torch function on each slice.

Run: python examples/nested_vmap_dict.py
"""

import jax
import jax.numpy as jnp
import numpy as np
import torch
from torch._subclasses.fake_tensor import is_fake

import torchjax

N, M = 5, 4  # outer and inner batch sizes
real_calls: list[tuple[int, ...]] = []  # per real call: the shape of the batch of d['a']


def features(d: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """{'a': [3], 'b': [6]} -> {'y': [3], 'norm': []}, written in torch."""
    # torchjax first runs the function on fake tensors to learn output shapes; inside
    # torch.func.vmap those are BatchedTensors around FakeTensors, which `is_fake` unwraps
    # (a bare `isinstance(x, FakeTensor)` would count them as real).
    if not is_fake(d["a"]):
        # Under torch.func.vmap `.shape` is the per-example shape; the unwrapped tensor
        # shows the whole batch this one call receives.
        real_calls.append(tuple(_unwrap(d["a"]).shape))
    y = torch.tanh(d["a"]) * torch.logsumexp(d["b"], dim=0)
    return {"y": y, "norm": torch.linalg.vector_norm(y)}


def _unwrap(t: torch.Tensor) -> torch.Tensor:
    while torch._C._functorch.is_batchedtensor(t):
        t = torch._C._functorch.get_unwrapped(t)
    return t


features_jax = torchjax.to_jax(features)
inner = jax.vmap(features_jax, in_axes=({"a": 0, "b": 1},))  # a: [M, 3], b: [6, M]
outer = jax.vmap(inner, in_axes=({"a": 0, "b": None},))  # a: [N, M, 3], b: [6, M]

key_a, key_b = jax.random.split(jax.random.key(0))
d = {"a": jax.random.normal(key_a, (N, M, 3)), "b": jax.random.normal(key_b, (6, M))}

out = outer(d)
print("eager: out['y']", out["y"].shape, "out['norm']", out["norm"].shape)
print("eager: real torch calls:", len(real_calls), "receiving a batch of shape", real_calls)
assert real_calls == [(N, M, 3)], real_calls  # one call for all N * M examples

real_calls.clear()
out_jit = jax.jit(outer)(d)
print("jit  : real torch calls:", len(real_calls), "receiving a batch of shape", real_calls)
assert real_calls == [(N, M, 3)], real_calls

# Reference: a Python loop of N * M calls of the plain torch function on torch tensors.
a, b = torch.from_numpy(np.array(d["a"])), torch.from_numpy(np.array(d["b"]))
ref = [[features({"a": a[i, j], "b": b[:, j]}) for j in range(M)] for i in range(N)]
ref_y = np.stack([[r["y"].numpy() for r in row] for row in ref])
ref_norm = np.array([[r["norm"].item() for r in row] for row in ref])

for result in (out, out_jit):
    np.testing.assert_allclose(result["y"], ref_y, rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(result["norm"], ref_norm, rtol=1e-5, atol=1e-6)
print("matches a Python loop of", N * M, "torch calls; max |diff| of y:", end=" ")
print(float(jnp.max(jnp.abs(out["y"] - ref_y))))

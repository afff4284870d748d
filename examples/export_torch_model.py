"""Serve a torch model from JAX alone: lowering="xla", jax.export, one artifact for every batch.

`module_to_jax(model, lowering="xla")` captures the model with torch.export and turns each
ATen op into JAX ops. The result is ordinary JAX, so `jax.export` serializes it, and a
symbolic batch dimension (`jax.export.symbolic_shape("batch")`) becomes a torch.export
dynamic dim: one artifact serves every batch size. The artifact then runs in a process
where `import torch` fails: the serving side needs JAX alone.

Checks: `lowering_report` finds no op run as a callback; the served outputs, for a batch
size never traced, equal the torch model's.

Run: python examples/export_torch_model.py
"""

import pathlib
import pickle
import subprocess
import sys
import tempfile

import jax
import jax.numpy as jnp
import numpy as np
import torch

import torchjax

torch.manual_seed(0)
model = torch.nn.Sequential(
    torch.nn.Linear(16, 64), torch.nn.GELU(), torch.nn.LayerNorm(64), torch.nn.Linear(64, 3)
).eval()
apply, variables = torchjax.module_to_jax(model, lowering="xla")

(batch,) = jax.export.symbolic_shape("batch")
example = jax.ShapeDtypeStruct((batch, 16), jnp.float32)  # [batch, 16] -> [batch, 3]
report = torchjax.lowering_report(apply, variables, example)
print(report)
assert report.fully_lowered and report.exportable

# The weights are arguments of the exported function, not constants baked into it.
exported = jax.export.export(jax.jit(apply))(variables, example)
print("exported for input shapes", [str(a.shape) for a in exported.in_avals])

SERVE = """
import sys
sys.modules["torch"] = None  # this process cannot import torch
import pickle
import numpy as np
from jax import export
exported = export.deserialize(open(sys.argv[1], "rb").read())
variables, x = pickle.load(open(sys.argv[2], "rb"))
np.save(sys.argv[3], np.asarray(exported.call(variables, x)))
"""

x = np.random.default_rng(0).standard_normal((37, 16)).astype(np.float32)  # batch 37
with tempfile.TemporaryDirectory() as name:
    tmp = pathlib.Path(name)
    (tmp / "model.jax").write_bytes(exported.serialize())
    host = jax.tree.map(np.asarray, variables)
    (tmp / "inputs.pkl").write_bytes(pickle.dumps((host, x)))
    subprocess.run(
        [
            sys.executable,
            "-c",
            SERVE,
            *(str(tmp / n) for n in ("model.jax", "inputs.pkl", "y.npy")),
        ],
        check=True,
    )
    served = np.load(tmp / "y.npy")

expected = model(torch.from_numpy(x)).detach().numpy()
np.testing.assert_allclose(served, expected, rtol=1e-5, atol=1e-5)
print(
    f"served a batch of {len(x)} without torch; max |served - torch| =",
    np.abs(served - expected).max(),
)

"""MCMC in JAX (numpyro's NUTS) on a log-density written in PyTorch.

The model is a Bayesian linear regression with known noise, y = X w + eps, eps ~ N(0, s^2),
and prior w ~ N(0, t^2 I). Its log-density is written in torch and wrapped with
`torchjax.to_jax`; NUTS needs its gradient, which `jax.grad` takes through torch's
autograd. The whole sampler runs jit-compiled with the torch call inside.

The posterior is Gaussian with a closed form, so the samples are checked against the exact
mean and standard deviation:
    cov = (X^T X / s^2 + I / t^2)^-1,   mean = cov X^T y / s^2.

Run: python examples/mcmc_torch_logdensity.py
"""

import jax
import jax.numpy as jnp
import numpy as np
import torch
from numpyro.infer import MCMC, NUTS

import torchjax

NOISE, PRIOR = 0.5, 2.0  # s and t above
N_DATA, DIM = 40, 2
NUM_WARMUP, NUM_SAMPLES = 200, 400

rng = np.random.default_rng(0)
X_np = rng.normal(size=(N_DATA, DIM)).astype(np.float32)
y_np = (X_np @ np.array([1.5, -0.7]) + NOISE * rng.normal(size=N_DATA)).astype(np.float32)
X_t, y_t = torch.from_numpy(X_np), torch.from_numpy(y_np)


@torchjax.to_jax
def log_density(w: torch.Tensor) -> torch.Tensor:
    """Unnormalised log posterior, in torch: w [2] -> scalar."""
    log_lik = -0.5 * torch.sum((y_t - X_t @ w) ** 2) / NOISE**2
    log_prior = -0.5 * torch.sum(w**2) / PRIOR**2
    return log_lik + log_prior


# numpyro's NUTS takes a potential energy: the negative log-density.
kernel = NUTS(potential_fn=lambda w: -log_density(w))
mcmc = MCMC(kernel, num_warmup=NUM_WARMUP, num_samples=NUM_SAMPLES, progress_bar=False)
mcmc.run(jax.random.key(0), init_params=jnp.zeros(DIM))
samples = np.asarray(mcmc.get_samples())  # [NUM_SAMPLES, 2]

# Exact posterior (float64 numpy, independent of torch and of the sampler).
X64, y64 = X_np.astype(np.float64), y_np.astype(np.float64)
cov = np.linalg.inv(X64.T @ X64 / NOISE**2 + np.eye(DIM) / PRIOR**2)
mean, std = cov @ X64.T @ y64 / NOISE**2, np.sqrt(np.diag(cov))

print("posterior mean: NUTS", samples.mean(0).round(4), " exact", mean.round(4))
print("posterior std : NUTS", samples.std(0).round(4), " exact", std.round(4))
print("posterior corr: NUTS", np.corrcoef(samples.T)[0, 1].round(3), end="  ")
print("exact", (cov[0, 1] / (std[0] * std[1])).round(3))

# Loose Monte Carlo tolerances: the mean's standard error is std / sqrt(ESS); allow 4 of
# them with a conservative ESS of NUM_SAMPLES / 4. The std within 20%.
mc_error = std / np.sqrt(NUM_SAMPLES / 4)
assert np.all(np.abs(samples.mean(0) - mean) < 4 * mc_error), (samples.mean(0), mean)
assert np.allclose(samples.std(0), std, rtol=0.2), (samples.std(0), std)
print("NUTS on the torch log-density matches the exact posterior")

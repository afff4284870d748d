"""NUTS in JAX (numpyro, and blackjax if installed) on a `torch.distributions` log-density.

The model is the mean of a Gaussian with known scale and a Gaussian prior:
    mu ~ Normal(M0, S0),   y_i ~ Normal(mu, SIGMA),  i = 1..N.
Its log-density is written with `torch.distributions` and wrapped with `to_jax`; the
samplers take its gradient through torch's autograd, inside their compiled loops.

`validate_args=False`: by default torch.distributions checks its arguments by reading their
values (`.item()`), which fake tensors, used to find output shapes under `jax.jit`, do not
have. Turning validation off (or `torch.distributions.Distribution.set_default_validate_args
(False)`) makes the log-density traceable.

The posterior is conjugate, Normal(mean, std) with
    1/std^2 = 1/S0^2 + N/SIGMA^2,   mean = std^2 (M0/S0^2 + sum(y)/SIGMA^2),
and each sampler's mean is checked against it (within 4 Monte Carlo standard errors).

Run: python examples/mcmc_torch_distributions.py
"""

import importlib.util

import jax
import jax.numpy as jnp
import numpy as np
import torch
from numpyro.infer import MCMC, NUTS

import torchjax

M0, S0, SIGMA, N = 0.0, 2.0, 1.0, 20
NUM_WARMUP, NUM_SAMPLES = 200, 400

rng = np.random.default_rng(0)
y_np = (1.3 + SIGMA * rng.normal(size=N)).astype(np.float32)
y_t = torch.from_numpy(y_np)


@torchjax.to_jax
def log_density(mu: torch.Tensor) -> torch.Tensor:  # [] -> []
    prior = torch.distributions.Normal(M0, S0, validate_args=False)
    likelihood = torch.distributions.Normal(mu, SIGMA, validate_args=False)
    return prior.log_prob(mu) + likelihood.log_prob(y_t).sum()


# Exact posterior, in float64 numpy: independent of torch and of the samplers.
post_std = (1 / S0**2 + N / SIGMA**2) ** -0.5
post_mean = post_std**2 * (M0 / S0**2 + y_np.astype(np.float64).sum() / SIGMA**2)
mc_error = post_std / np.sqrt(NUM_SAMPLES / 4)  # a conservative ESS of NUM_SAMPLES / 4


def check(name, samples):
    samples = np.asarray(samples)
    print(f"{name:9s} posterior mean {samples.mean():.4f}  std {samples.std():.4f}", end="   ")
    print(f"exact mean {post_mean:.4f}  std {post_std:.4f}")
    assert samples.shape == (NUM_SAMPLES,), samples.shape
    assert abs(samples.mean() - post_mean) < 4 * mc_error, (samples.mean(), post_mean)
    assert abs(samples.std() / post_std - 1) < 0.25, (samples.std(), post_std)


# numpyro: NUTS on a potential energy (the negative log-density).
mcmc = MCMC(
    NUTS(potential_fn=lambda mu: -log_density(mu)),
    num_warmup=NUM_WARMUP,
    num_samples=NUM_SAMPLES,
    progress_bar=False,
)
mcmc.run(jax.random.key(0), init_params=jnp.float32(0.0))
check("numpyro", mcmc.get_samples())

if importlib.util.find_spec("blackjax") is None:
    print("blackjax is not installed: skipped its NUTS")
else:
    import blackjax

    warmup = blackjax.window_adaptation(blackjax.nuts, log_density)
    key_warmup, key_sample = jax.random.split(jax.random.key(1))
    (state, parameters), _ = warmup.run(key_warmup, jnp.float32(0.0), num_steps=NUM_WARMUP)
    kernel = blackjax.nuts(log_density, **parameters).step

    @jax.jit
    def sample(state, key):
        def one_step(state, key):
            state, _ = kernel(key, state)
            return state, state.position

        return jax.lax.scan(one_step, state, jax.random.split(key, NUM_SAMPLES))[1]

    check("blackjax", sample(state, key_sample))

print("NUTS on the torch.distributions log-density matches the exact posterior")

"""Fine-tune a Hugging Face transformer with optax: a tiny GPT-2 through module_to_jax.

The model is `transformers.GPT2LMHeadModel` with a tiny random config (no download). With
`return_dict=False, use_cache=False` its forward returns a tuple of tensors, so
`module_to_jax` makes it a pure JAX function of its params. The next-token cross-entropy is
written in JAX, and a few `optax.adam` steps run under `jax.jit` (the torch forward and its
vjp run inside the compiled step).

Checks: the first gradient equals the one torch autograd computes for the same loss written
in torch (`loss.backward()` on the module itself), and the loss decreases.

Run: python examples/hf_gpt2_optax.py
"""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import torch
from transformers import GPT2Config, GPT2LMHeadModel

import torchjax

VOCAB, SEQ, BATCH, STEPS = 100, 16, 4, 5

torch.manual_seed(0)
config = GPT2Config(
    n_layer=1, n_embd=32, n_head=2, vocab_size=VOCAB, n_positions=SEQ,
    resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0, bos_token_id=0, eos_token_id=0,
)  # fmt: skip
model = GPT2LMHeadModel(config).eval()  # dropout off: value and gradient are deterministic
apply, variables = torchjax.module_to_jax(model)
buffers = variables["buffers"]

rng = np.random.default_rng(0)
tokens_np = rng.integers(0, VOCAB, size=(BATCH, SEQ))
tokens = jnp.asarray(tokens_np, jnp.int32)


def loss_fn(params, tokens):  # tokens [B, T] -> scalar
    (logits,) = apply(
        {"params": params, "buffers": buffers}, tokens, return_dict=False, use_cache=False
    )  # [B, T, V]
    logp = jax.nn.log_softmax(logits[:, :-1], axis=-1)
    target = tokens[:, 1:]
    return -jnp.mean(jnp.take_along_axis(logp, target[..., None], axis=-1))


optimizer = optax.adam(1e-2)


@jax.jit
def step(params, opt_state, tokens):
    loss, grads = jax.value_and_grad(loss_fn)(params, tokens)
    updates, opt_state = optimizer.update(grads, opt_state, params)
    return optax.apply_updates(params, updates), opt_state, loss, grads


# Reference gradient: the same loss in torch, on the module itself, by loss.backward().
tokens_t = torch.as_tensor(tokens_np)
(logits_t,) = model(tokens_t, return_dict=False, use_cache=False)
loss_t = torch.nn.functional.cross_entropy(
    logits_t[:, :-1].reshape(-1, VOCAB), tokens_t[:, 1:].reshape(-1)
)
loss_t.backward()
torch_grads = {name: p.grad.numpy() for name, p in model.named_parameters()}

params = variables["params"]
opt_state = optimizer.init(params)
losses = []
for i in range(STEPS):
    params, opt_state, loss, grads = step(params, opt_state, tokens)
    losses.append(float(loss))
    if i == 0:
        np.testing.assert_allclose(loss, loss_t.item(), rtol=1e-5)
        assert set(grads) == set(torch_grads), set(grads) ^ set(torch_grads)
        for name, g in grads.items():
            np.testing.assert_allclose(g, torch_grads[name], rtol=1e-4, atol=1e-6, err_msg=name)
        print(f"step 0: loss and gradient of all {len(grads)} params match torch autograd")

print("loss", " -> ".join(f"{x:.4f}" for x in losses))
assert losses[-1] < losses[0] - 0.1, losses
print("the optax steps lower the tiny GPT-2's loss")

# A BatchNorm ResNet training step through module_to_jax, against torch's own step.
#
# A CIFAR-style ResNet written in torch (no torchvision: BasicBlocks of two 3x3 convolutions
# with BatchNorm and a shortcut, three stages of 16, 32 and 64 channels, two blocks each,
# global average pooling and a linear head; 0.18M parameters), in train mode, on a batch of
# 64 images of 3 x 32 x 32 with 10 classes, cross entropy, SGD with momentum 0.9. BatchNorm
# updates its running statistics on every step: torchjax carries them with
# `apply(..., mutable=True)` as the loss's aux output. torchjax: jax.jit of value_and_grad of
# the loss computed in JAX from apply's logits, then optax.sgd's update, the parameters,
# buffers and optimizer state donated. torch: forward, the same loss, backward,
# torch.optim.SGD(momentum=0.9).step, zero_grad(set_to_none=True). Both start from the same
# weights and data; three steps of each are checked to give the same losses, weights and
# running statistics before timing. A second pair times both without the optimizer
# (forward, loss and gradients: what the bridge does). compare.py --quick uses 8 images and
# stages of 8, 16 and 32 channels.
#
# Usage: `python benchmarks/bench_resnet.py`
from __future__ import annotations

import _timing
import jax
import jax.numpy as jnp
import numpy as np
import optax
import torch
from _timing import Table, format_tables, paired_row

import torchjax

CLASSES, LR, MOMENTUM = 10, 0.05, 0.9
FULL = {"batch": 64, "widths": (16, 32, 64)}
QUICK = {"batch": 8, "widths": (8, 16, 32)}


class BasicBlock(torch.nn.Module):
    def __init__(self, c_in: int, c_out: int, stride: int):
        super().__init__()
        self.conv1 = torch.nn.Conv2d(c_in, c_out, 3, stride, 1, bias=False)
        self.bn1 = torch.nn.BatchNorm2d(c_out)
        self.conv2 = torch.nn.Conv2d(c_out, c_out, 3, 1, 1, bias=False)
        self.bn2 = torch.nn.BatchNorm2d(c_out)
        self.shortcut = torch.nn.Sequential()
        if stride != 1 or c_in != c_out:
            self.shortcut = torch.nn.Sequential(
                torch.nn.Conv2d(c_in, c_out, 1, stride, bias=False), torch.nn.BatchNorm2d(c_out)
            )

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # [N, C, H, W] -> [N, C', H', W']
        h = torch.relu(self.bn1(self.conv1(x)))
        return torch.relu(self.bn2(self.conv2(h)) + self.shortcut(x))


class ResNet(torch.nn.Module):
    def __init__(self, widths: tuple[int, int, int]):
        super().__init__()
        self.stem = torch.nn.Sequential(
            torch.nn.Conv2d(3, widths[0], 3, 1, 1, bias=False),
            torch.nn.BatchNorm2d(widths[0]),
            torch.nn.ReLU(),
        )
        blocks, c_in = [], widths[0]
        for i, c_out in enumerate(widths):
            stride = 1 if i == 0 else 2
            blocks += [BasicBlock(c_in, c_out, stride), BasicBlock(c_out, c_out, 1)]
            c_in = c_out
        self.blocks = torch.nn.Sequential(*blocks)
        self.head = torch.nn.Linear(c_in, CLASSES)

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # [N, 3, 32, 32] -> [N, 10]
        return self.head(self.blocks(self.stem(x)).mean(dim=(2, 3)))


def _setup(config: dict) -> tuple:
    torch.manual_seed(0)
    model = ResNet(config["widths"]).train()
    twin = ResNet(config["widths"]).train()
    twin.load_state_dict(model.state_dict())
    rng = np.random.default_rng(0)
    images = torch.from_numpy(rng.standard_normal((config["batch"], 3, 32, 32)).astype("f4"))
    labels = torch.from_numpy(rng.integers(0, CLASSES, config["batch"]))
    return model, twin, images, labels


def _jax_steps(model: torch.nn.Module):
    """The jitted step and the gradients alone, and their starting state."""
    apply, variables = torchjax.module_to_jax(model)
    opt = optax.sgd(LR, momentum=MOMENTUM)

    def loss(params, buffers, images, labels):
        logits, new_buffers = apply({"params": params, "buffers": buffers}, images, mutable=True)
        logp = jax.nn.log_softmax(logits, axis=-1)
        return -jnp.mean(jnp.take_along_axis(logp, labels[:, None], axis=-1)), new_buffers

    def step(params, buffers, opt_state, images, labels):
        (value, buffers), grads = jax.value_and_grad(loss, has_aux=True)(
            params, buffers, images, labels
        )
        updates, opt_state = opt.update(grads, opt_state, params)
        return value, optax.apply_updates(params, updates), buffers, opt_state

    state = [variables["params"], variables["buffers"], opt.init(variables["params"])]
    grads_only = jax.jit(jax.value_and_grad(loss, has_aux=True))
    return jax.jit(step, donate_argnums=(0, 1, 2)), grads_only, state


def _torch_steps(model: torch.nn.Module):
    opt = torch.optim.SGD(model.parameters(), lr=LR, momentum=MOMENTUM)

    def grads(images, labels):
        value = torch.nn.functional.cross_entropy(model(images), labels)
        value.backward()
        return value

    def step(images, labels):
        value = grads(images, labels)
        opt.step()
        opt.zero_grad(set_to_none=True)
        return value.item()

    def grads_only(images, labels):
        value = grads(images, labels)
        model.zero_grad(set_to_none=True)
        return value.item()

    return step, grads_only


def _check_same(jax_step, state: list, torch_step, twin, images, labels, x, y) -> None:
    """Three steps of each side: the same losses, weights and running statistics (float32
    rounding apart: XLA's log-softmax and torch's cross entropy differ in the last bits,
    which three steps through BatchNorm grow to about 1e-4)."""
    for _ in range(3):
        value, *state[:] = jax_step(*state, x, y)
        want = torch_step(images, labels)
        if abs(float(value) - want) > 1e-4 * max(1.0, abs(want)):
            raise AssertionError(f"the steps' losses differ: {float(value)} and {want}")
    params, buffers, _ = state
    for name, p in twin.named_parameters():
        np.testing.assert_allclose(np.asarray(params[name]), p.detach().numpy(), atol=1e-3)
    for name, b in twin.named_buffers():
        np.testing.assert_allclose(np.asarray(buffers[name]), b.numpy(), atol=1e-3)


def measure() -> list[Table]:
    config = QUICK if _timing.REPEAT <= 2 else FULL  # compare.py --quick: 2 repeats
    model, twin, images, labels = _setup(config)
    x, y = torchjax.tree_to_jax((images, labels))
    jax_step, jax_grads, state = _jax_steps(model)
    torch_step, torch_grads = _torch_steps(twin)
    _check_same(jax_step, state, torch_step, twin, images, labels, x, y)

    def run_jax_step():
        value, *state[:] = jax_step(*state, x, y)
        return float(value)

    def run_jax_grads():
        (value, _), grads = jax_grads(state[0], state[1], x, y)
        jax.block_until_ready(grads)
        return float(value)

    size = f"{config['batch']} images of 3 x 32 x 32, stages of {config['widths']} channels"
    return [
        (
            f"BatchNorm ResNet, {size}, SGD with momentum",
            [
                paired_row(
                    "jax.jit(value_and_grad + optax.sgd) via module_to_jax, mutable=True",
                    run_jax_step,
                    "torch forward, loss, backward, SGD(momentum) step",
                    lambda: torch_step(images, labels),
                ),
                paired_row(
                    "jax.jit(value_and_grad) via module_to_jax, no optimizer",
                    run_jax_grads,
                    "torch forward, loss, backward, no optimizer",
                    lambda: torch_grads(images, labels),
                ),
            ],
        )
    ]


format_results = format_tables  # measure()'s tables as the markdown that main() prints


def main() -> None:
    print(format_results(measure()), end="")


if __name__ == "__main__":
    main()

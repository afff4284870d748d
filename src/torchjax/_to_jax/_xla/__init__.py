# lowering="xla": a torch function torch.export'ed per input signature, each ATen node of
# its graph turned into JAX ops through torchax's op table, and a node the table cannot
# lower bound to the callback primitive, so a real torch kernel runs there and every
# transform still works. The result is an ordinary JAX function: XLA fuses it, jax.export
# serializes it, sharded inputs partition.

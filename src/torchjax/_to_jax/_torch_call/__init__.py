"""How JAX sees a torch call: the torch_call primitive and its rules, one file each."""

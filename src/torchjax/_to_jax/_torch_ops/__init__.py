"""Torch-side building blocks: autograd, vmap, kept graphs, random state, autocast."""

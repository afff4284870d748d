"""What torch computes: the user's function and the callables derived from it."""

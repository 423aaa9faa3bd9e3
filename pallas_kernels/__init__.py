"""Pallas kernels, each beside its pure-jnp reference. Imports only jax."""

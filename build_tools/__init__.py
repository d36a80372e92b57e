"""Helpers for building deep_ep_jax (setup.py, bazel/configure.py); not installed."""

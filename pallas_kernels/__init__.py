"""Pallas GPU kernels used by jaxllm, each next to a pure-JAX reference."""

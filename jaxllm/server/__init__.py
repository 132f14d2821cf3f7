"""OpenAI-compatible HTTP server (`jaxllm serve`)."""

"""The OpenAI-compatible HTTP server (aiohttp). No jax: the engine is built by the caller."""

"""The agent-facing front: OpenAI routes, the prompt path, streaming, upstream adapters and weight swaps."""

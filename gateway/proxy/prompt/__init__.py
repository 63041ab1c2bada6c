"""gateway/proxy/prompt."""

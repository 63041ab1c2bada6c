"""gateway/api."""

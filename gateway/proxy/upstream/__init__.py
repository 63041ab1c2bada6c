"""tracegym gateway/upstream."""

"""tracegym gateway/store."""

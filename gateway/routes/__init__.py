"""tracegym gateway/routes."""

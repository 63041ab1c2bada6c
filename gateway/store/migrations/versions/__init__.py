"""tracegym gateway/store/migrations/versions."""

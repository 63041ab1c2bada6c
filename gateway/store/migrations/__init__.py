"""tracegym gateway/store/migrations."""

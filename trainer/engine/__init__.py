"""tracegym trainer/engine."""

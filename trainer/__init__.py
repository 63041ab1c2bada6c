"""tracegym trainer: embedded engine, models, algorithms, Ray/FSDP2 workers, the training loop."""

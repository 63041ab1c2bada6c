"""The training workers: Ray actors running FSDP2, their batches, LoRA on the model, placement on a Ray cluster."""

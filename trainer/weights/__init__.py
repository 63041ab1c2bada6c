"""Everything the trainer does to push new weights to the engines: through disk, distributed, full or LoRA adapters."""

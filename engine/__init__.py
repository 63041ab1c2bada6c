"""The embedded inference engine: SGLang's native HTTP API over a transformers model, with continuous batching, hot weight swaps and LoRA adapters."""

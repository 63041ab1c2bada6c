"""Model directories shared by the trainer and the engine: preparing named models, loading them, writing folders atomically, the adapter format."""

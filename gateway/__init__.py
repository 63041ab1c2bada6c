"""tracegym gateway: FastAPI app, upstream adapters, templating, tracing, store. Never imports torch."""

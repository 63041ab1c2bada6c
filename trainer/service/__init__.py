"""The training service: the Tinker API over the trainer (``tracegym tinker-serve``, docs/tinker.md)."""

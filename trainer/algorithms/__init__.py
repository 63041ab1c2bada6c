"""The training objectives as pure functions: advantages, policy losses, the optimiser's schedule, and the registry that names them."""

"""Recording, the trace store, and assembly: spans in, trajectories out. Imports nothing from proxy or api."""

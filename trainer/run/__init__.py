"""One training run: the loop, the services it starts, run directories, progress and reports, tasks, the gateway client, the group judge."""

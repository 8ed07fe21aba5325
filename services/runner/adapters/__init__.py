"""Side effects of the runner: workspaces, harness processes, snapshots."""

"""The `tandem` command: models, generate, serve (bench comes from cluster/bench)."""

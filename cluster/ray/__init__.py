"""The engine on Ray: shard actors and their executor, replica and router actors, TandemCluster."""

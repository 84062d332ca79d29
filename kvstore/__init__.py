"""Memory: KV blocks, chained block hashes, the prefix cache and KV events.

Imports nothing of ours."""

"""Profilers of the engine, the host and the collectives (tools/README.md)."""

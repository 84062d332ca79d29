"""Decisions: the continuous-batching scheduler, sequences, sampling parameters, placement.

Imports kvstore only."""

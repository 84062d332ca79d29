"""EAGLE heads: a one-layer draft over the target's own hidden states (EAGLE-1, EAGLE-3)."""

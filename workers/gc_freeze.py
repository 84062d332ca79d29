"""Keeps Python's cyclic garbage collector off the objects a process builds at start-up.

A started engine holds hundreds of thousands of long-lived objects (the model's modules and
parameters, the KV block pool, the CUDA graphs' bookkeeping) that a full (generation 2)
collection walks every time. On an H200 running W2, two such collections over ~425,000 objects
took 0.52-0.60 s of a 5.9 s run, the host stalled while the GPU waited; frozen after start-up,
the one full collection left took 2 ms (docs/benchmarks.md). Garbage made later, while
serving, is collected as before. Shutting an engine down unfreezes, so what it leaves behind
in reference cycles can be collected again.
"""

import gc


def freeze_start_up_objects() -> int:
    """Collects what start-up left behind, then moves every survivor out of the collector's
    reach (``gc.freeze``); returns how many objects are frozen."""
    gc.collect()
    gc.freeze()
    return gc.get_freeze_count()


def unfreeze() -> None:
    """Hands the frozen objects back to the collector (they are scanned again from the next
    full collection on)."""
    gc.unfreeze()

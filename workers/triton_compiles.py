"""Records every Triton kernel specialization a process compiles (or loads from the disk
cache): each is a stall of up to a second, so one that happens while serving, after the
warm-up, is a bug worth seeing. ``record()`` starts it; ``seen`` lists what came since."""

import time
from dataclasses import dataclass


@dataclass(frozen=True)
class Compile:
    at: float  # time.monotonic()
    kernel: str
    key: str  # the specialization: argument types, alignments, divisibility


seen: list[Compile] = []


def _on_compile(**hook_args: object) -> None:
    fn, details = hook_args.get("fn"), hook_args.get("compile")
    key = details.get("key") if isinstance(details, dict) else None
    seen.append(Compile(time.monotonic(), getattr(fn, "name", "?"), str(key)))
    # returns None: Triton goes on and compiles


def record() -> None:
    try:
        from triton import knobs
    except ImportError:  # no Triton (macOS, or the CPU-only install): nothing compiles
        return

    knobs.runtime.jit_cache_hook = _on_compile

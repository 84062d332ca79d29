"""Records every Triton kernel specialization a process compiles (or loads from the disk
cache): each is a stall of up to a second, so one that happens inside a timed run, after the
warm-up, is a gap in the warm-up worth seeing."""

import time
from dataclasses import dataclass, field


@dataclass(frozen=True)
class Compile:
    at: float  # time.monotonic()
    kernel: str
    key: str  # the specialization: argument types, alignments, divisibility


@dataclass
class CompileLog:
    """``CompileLog.start()`` hooks Triton's JIT cache; ``seen`` lists what came since.

    Triton has one hook a process, so the last log started is the one that records."""

    seen: list[Compile] = field(default_factory=list)

    @classmethod
    def start(cls) -> "CompileLog":
        log = cls()
        try:
            from triton import knobs
        except ImportError:  # no Triton (macOS, or the CPU-only install): nothing compiles
            return log
        knobs.runtime.jit_cache_hook = log.on_compile
        return log

    def on_compile(self, **hook_args: object) -> None:
        fn, details = hook_args.get("fn"), hook_args.get("compile")
        key = details.get("key") if isinstance(details, dict) else None
        self.seen.append(Compile(time.monotonic(), getattr(fn, "name", "?"), str(key)))
        # returns None: Triton goes on and compiles

    def since(self, count: int) -> list[str]:
        """What compiled after the first ``count`` entries, one line each."""
        return [f"{c.kernel} {c.key}" for c in self.seen[count:]]

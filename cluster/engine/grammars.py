"""Requests whose output follows a grammar wait here while it compiles, off the engine loop.

Compiling takes milliseconds to seconds (a schema of many tools); the step loop must not wait
for it, so it runs on a small thread pool (xgrammar releases the GIL) and the request's
sequences join the scheduler only once theirs is ready. A spec compiled before comes from
xgrammar's cache at once. A grammar that fails to compile fails its own request, nothing
else. The backend (and its ~3 s import) is loaded by the first request that needs it.
"""

import threading
from collections import OrderedDict
from concurrent.futures import FIRST_COMPLETED, Future, ThreadPoolExecutor, wait
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from router.sequence import Sequence
from router.structured_outputs import StructuredOutputs

MAX_COMPILED = 256


class GrammarViolation(Exception):
    """A row's output holds a token its grammar does not allow (the worker reports it): a
    fault of the masks' path. Its request fails alone."""


@dataclass
class WaitingRequest:
    request_id: str
    sequences: list[Sequence]
    grammar: "Future[Any]" = field(repr=False)


class GrammarCompiles:
    def __init__(self, tokenizer: Any, folder: Path, vocab_size: int,
                 stop_ids: frozenset[int]) -> None:
        self.tokenizer, self.folder, self.vocab_size = tokenizer, folder, vocab_size
        self.stop_ids = sorted(stop_ids)
        self._compiler: Any = None
        self._lock = threading.Lock()
        self._pool: ThreadPoolExecutor | None = None
        self.waiting: list[WaitingRequest] = []
        # the specs compiled lately (a GrammarRef each, shared by their requests), newest last
        self._compiled: OrderedDict[tuple[str, str, bool], Any] = OrderedDict()
        self._cache_lock = threading.Lock()  # not _lock: that one is held while tables build

    def add(self, request_id: str, structured: StructuredOutputs,
            sequences: list[Sequence]) -> None:
        with self._cache_lock:  # the pool's threads add to it
            compiled = self._compiled.get(structured.key)
            if compiled is not None:
                self._compiled.move_to_end(structured.key)
        if compiled is not None:  # no trip through the pool: it joins in this very step
            future: Future[Any] = Future()
            future.set_result(compiled)
        else:
            if self._pool is None:
                self._pool = ThreadPoolExecutor(max_workers=2,
                                                thread_name_prefix="tandem-grammar")
            future = self._pool.submit(self._compile, structured)
        self.waiting.append(WaitingRequest(request_id, sequences, future))

    def _compile(self, structured: StructuredOutputs) -> Any:
        with self._lock:  # the tokenizer's tables are built once, by the first compile
            if self._compiler is None:
                from workers.structured.backend import GrammarCompiler

                self._compiler = GrammarCompiler(self.tokenizer, self.vocab_size,
                                                 self.stop_ids, self.folder)
        compiled = self._compiler.compile(structured)
        with self._cache_lock:
            self._compiled[structured.key] = compiled
            if len(self._compiled) > MAX_COMPILED:
                self._compiled.popitem(last=False)
        return compiled

    def ready(self) -> list[tuple[WaitingRequest, Any, BaseException | None]]:
        """The waiting requests whose grammar is done: (request, grammar, error), in order."""
        done = [w for w in self.waiting if w.grammar.done()]
        if done:
            self.waiting = [w for w in self.waiting if not w.grammar.done()]
        return [(w, None if w.grammar.exception() else w.grammar.result(), w.grammar.exception())
                for w in done]

    def wait(self, timeout: float) -> None:
        """Until one waiting grammar is done or ``timeout`` seconds pass (an idle engine)."""
        if self.waiting:
            wait([w.grammar for w in self.waiting], timeout, return_when=FIRST_COMPLETED)

    def drop(self, request_id: str) -> bool:
        """Forgets an aborted request's wait; whether it was waiting."""
        before = len(self.waiting)
        self.waiting = [w for w in self.waiting if w.request_id != request_id]
        return len(self.waiting) != before

    def shutdown(self) -> None:
        if self._pool is not None:
            self._pool.shutdown(wait=False, cancel_futures=True)

"""KV blocks pulled from one replica's host tier into another's, through Ray's object store.

The router decides (router/kv_pricing.py, placement.py); this carries it out::

    source replica   between steps: pins the prefix's leading blocks in its host tier
                     (``TierManager.start_export``); each shard copies its share of them into
                     the object store; once all have, they are unpinned
    the caller       hands the shards' object refs to the target with the request
    target replica   each shard receives its rank's rows (``stage_host_import``); between
                     steps the engine gives them host slots and queues the request, whose
                     lookup finds them there and loads them like any host-tier hit

The bytes go shard to object store to shard; the replicas and the caller handle only refs.
Anything that fails (a shard, a layout of another model, a replica rebuilt meanwhile) drops the
pull: the request recomputes those tokens.
"""

import asyncio
import logging
import uuid
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass

import numpy as np
import ray

from kvstore.block_hash import BlockHash
from kvstore.transfers import HostImport

log = logging.getLogger(__name__)

EXPORT_TRIES = 5  # the last step's blocks may still be on their way to the host tier
PULL_PROBE_BYTES = 8 << 20


@dataclass(frozen=True)
class ExportedBlocks:
    """A prefix's blocks read out of a replica's host tier: one object ref per shard, rank
    first, each a (blocks, block bytes) uint8 tensor of that shard's share."""

    source: int
    layout_tag: str
    hashes: tuple[BlockHash, ...]
    token_ids: tuple[tuple[int, ...], ...]
    shard_rows: tuple  # ray.ObjectRef per shard, nested so that Ray leaves them refs

    @property
    def num_blocks(self) -> int:
        return len(self.hashes)


Between = Callable[[Callable[[], object]], Awaitable[object]]  # runs a call between steps


async def export_blocks(engine, between_steps: Between, source: int,
                        hashes: Sequence[BlockHash],
                        token_ids: Sequence[Sequence[int]]) -> ExportedBlocks | None:
    """The leading blocks of ``hashes`` that ``engine``'s host tier holds, copied by its
    shards into the object store; None when it holds none."""
    tiers = engine.scheduler.kv.tiers
    if tiers is None or not hashes:
        return None
    export_id = uuid.uuid4().hex
    slots: list[int] = []
    for _ in range(EXPORT_TRIES):
        slots = await between_steps(lambda: tiers.start_export(export_id, hashes, token_ids))
        if len(slots) == len(hashes) or hashes[len(slots)] not in tiers.pending:
            break
        await between_steps(lambda: tiers.finish_export(export_id))  # the next step writes it
        await asyncio.sleep(0.01)
    if not slots:
        await between_steps(lambda: tiers.finish_export(export_id))
        return None
    refs = engine.executor.export_host_slots(slots)
    try:  # the pins hold until every shard has copied its share out
        await asyncio.to_thread(ray.wait, refs, num_returns=len(refs), fetch_local=False)
    finally:
        await between_steps(lambda: tiers.finish_export(export_id))
    count = len(slots)
    return ExportedBlocks(source, engine.offload_layout, tuple(hashes[:count]),
                          tuple(tuple(t) for t in token_ids[:count]), tuple(refs))


async def stage_pull(engine, pull: ExportedBlocks) -> str | None:
    """Every shard of ``engine`` receives its rank's rows; the import id to plan them under,
    or None when they cannot be used here (the request then recomputes them)."""
    tiers = engine.scheduler.kv.tiers
    if tiers is None or pull.layout_tag != engine.offload_layout:
        log.warning("pulled KV blocks of layout %s dropped: this replica's is %s",
                    pull.layout_tag, engine.offload_layout)
        return None
    import_id = uuid.uuid4().hex
    try:
        await asyncio.gather(*engine.executor.stage_host_import(import_id,
                                                                list(pull.shard_rows)))
    except Exception as error:  # the source's shard or process died, or a shape differs
        log.warning("pulling %d KV blocks from replica %d failed (%r): they are recomputed",
                    pull.num_blocks, pull.source, error)
        tiers.plan.imports.append(HostImport(import_id, [], []))  # what some shards staged
        return None
    return import_id


def import_pull(engine, import_id: str, pull: ExportedBlocks) -> int:
    """Between steps: host slots for the staged blocks (written by the next step)."""
    return engine.scheduler.kv.tiers.import_blocks(import_id, pull.hashes, pull.token_ids)


def block_tokens(prompt_ids: Sequence[int], block_size: int, first: int,
                 count: int) -> list[list[int]]:
    return [list(prompt_ids[i * block_size:(i + 1) * block_size])
            for i in range(first, first + count)]


def measure_pull_bandwidth(router) -> float:
    """Bytes a second from this process's object store into another actor's (the router's),
    the path pulled blocks take; measured once at start-up."""
    ref = ray.put(np.zeros(PULL_PROBE_BYTES, dtype=np.uint8))
    seconds = ray.get(router.time_fetch.remote([ref]))
    return PULL_PROBE_BYTES / max(seconds, 1e-9)

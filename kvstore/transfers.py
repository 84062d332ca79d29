"""The copies between KV tiers that one step asks of the workers, and what they report back.

Plain lists of ids, small enough for every step message. The workers do them in this order,
which is what makes reusing a slot or a block within one step safe::

    cancelled      loads of sequences gone since: their copies not started yet never are
                   (their device blocks may be handed out again in this very step)
    to_disk        host slot -> file        blocks leaving the host tier, before their slot
                                            is written again below
    disk_deletes   file -> nothing          blocks the disk tier evicted: after their writes
                                            (queued in this step or before), on the same queue
    stores_first   device block -> host     blocks the GPU pool handed out again in this
                                            step: copied before the forward overwrites them
    imports        staged bytes -> host     blocks pulled from another replica's host tier
                   slot                     (staged in each shard before this step)
    from_disk      file -> host slot        (checked on read)
    loads          host slot -> device block
    -- the forward --
    stores         device block -> host     write-through of blocks cached last step
"""

from dataclasses import dataclass, field

from kvstore.block_hash import BlockHash


@dataclass
class DiskWrite:
    slot: int
    block_hash: BlockHash
    token_ids: tuple[int, ...]  # written into the file's header, checked by its readers


@dataclass
class DiskRead:
    block_hash: BlockHash
    token_ids: tuple[int, ...]  # the prefix's tokens: a file of other tokens is refused
    slot: int


@dataclass
class BlockLoad:
    """One sequence's blocks coming back to the device: ``host_slots[i]`` -> ``block_ids[i]``.
    Reported done once every copy has landed, with how many of them (a prefix) succeeded."""

    request_id: str
    host_slots: list[int]
    block_ids: list[int]
    # the sequence runs in this step, its forward reading these blocks (a load from the host
    # tier alone): a copy that fails fails the step rather than leave it to read wrong KV
    in_step: bool = False


@dataclass
class HostImport:
    """Blocks another replica exported, staged in every shard under ``import_id`` (one row
    a block): rows ``rows[i]`` go into host slots ``slots[i]``; the staged bytes are dropped
    after (no rows: nothing of them was wanted)."""

    import_id: str
    rows: list[int]
    slots: list[int]


@dataclass
class KVTransfers:
    cancelled: list[str] = field(default_factory=list)  # request ids
    to_disk: list[DiskWrite] = field(default_factory=list)
    disk_deletes: list[BlockHash] = field(default_factory=list)
    stores_first: list[tuple[int, int]] = field(default_factory=list)  # (device block, slot)
    imports: list[HostImport] = field(default_factory=list)
    from_disk: list[DiskRead] = field(default_factory=list)
    loads: list[BlockLoad] = field(default_factory=list)
    stores: list[tuple[int, int]] = field(default_factory=list)  # (device block, slot)

    @property
    def is_empty(self) -> bool:
        return not (self.cancelled or self.to_disk or self.disk_deletes or self.stores_first
                    or self.imports
                    or self.from_disk or self.loads or self.stores)


@dataclass(frozen=True)
class StepCost:
    """A step that computed prompt tokens or loaded blocks, as the driver worker timed it on a
    GPU: the compute stream's time from its copies to its end (the device's time, or the
    host's launches where the device waited for them: whichever bounds the step;
    workers/step_timer.py). The rates a load is priced by (router/live_rates.py) come from
    these."""

    prompt_tokens: int  # in rows of more than one new token (drafts aside)
    total_tokens: int
    loaded_blocks: int  # host-tier blocks loaded before its forward
    seconds: float


@dataclass
class TransferReport:
    """What the workers finished since their last report."""

    # request id -> how many of its load's blocks arrived intact (all of them, or the ones
    # before the first that failed), for every load whose copies have all landed
    loaded: dict[str, int] = field(default_factory=dict)
    failed_reads: list[BlockHash] = field(default_factory=list)  # disk reads refused
    disk_error: str | None = None  # the disk tier failed (full, unwritable): switch it off
    # device <-> host copies finished since, and their time on the copy stream: the rate
    copied_bytes: int = 0
    copy_seconds: float = 0.0
    steps: list[StepCost] = field(default_factory=list)  # timed since, in the order they ran

    @property
    def is_empty(self) -> bool:
        return not (self.loaded or self.failed_reads or self.disk_error or self.copied_bytes
                    or self.steps)

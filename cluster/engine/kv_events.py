"""An engine's KV events as numbered batches for the cluster's KV directory (kvstore/directory).

One batch a step, numbered within the engine's epoch (a random id made when the engine is:
a rebuilt or restarted engine starts a new one, and the directory then forgets what the old one
held). ``dump`` gives every hash the device cache and the host tier hold, for a directory that
missed a batch.
"""

import time
import uuid

from kvstore.directory import CacheDump, EventBatch
from kvstore.kv_cache_manager import KVCacheManager


class KVEventPublisher:
    def __init__(self, kv: KVCacheManager, replica: int) -> None:
        self.kv = kv
        self.replica = replica
        self.epoch = uuid.uuid4().hex
        self.next_seq = 0

    def take_batch(self) -> EventBatch | None:
        """The events since the last batch, numbered; None when there were none."""
        events = self.kv.take_events()
        if not events:
            return None
        batch = EventBatch(self.replica, self.epoch, self.next_seq, tuple(events), time.time())
        self.next_seq += 1
        return batch

    def dump(self) -> CacheDump:
        """Every hash of each tier, as of the last batch taken. Events not taken yet are
        already in the dump and come again in the next batch: replaying adds and removals over
        the state they led to gives that state again (each tier is a set of its own)."""
        return CacheDump(self.replica, self.epoch, self.next_seq - 1, self.kv.cached_hashes(),
                         self.kv.host_hashes())

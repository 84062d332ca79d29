"""The draft model as a Ray actor of its own (``speculative_config`` ``placement: actor``).

One actor per draft model and cluster, found by name: every target replica that speculates
with that model shares it, each with a cache of its own (its blocks are the replica's block
ids). The actor asks Ray for its own GPU or a fraction of one (``draft_gpus``), so it can sit
beside a target of any tensor-parallel size, or on a smaller GPU than the target's.

In a step where some rows draft, the engine asks the actor for their drafts before it sends
the step to its workers (with each row's tokens and blocks gained since it last drafted): one
round trip more a drafting step than a draft inside the worker, the price of sharing and
placing it freely. Steps without drafts never reach the actor.
"""

import ray

from cluster.ray.start import init_ray
from workers.speculative.draft_follower import DraftFollower, DraftRow


class DraftActor:
    def __init__(self, folder: str, dtype: str, device: str, block_size: int,
                 num_drafts: int, attention_backend: str) -> None:
        import torch

        from workers.worker_config import DTYPES, make_attention_backend

        self.folder, self.block_size, self.num_drafts = folder, block_size, num_drafts
        self.device = torch.device(device)
        if self.device.type == "cuda" and self.device.index is None:
            self.device = torch.device("cuda", torch.cuda.current_device())
        if dtype == "auto":
            self.dtype = torch.float32 if self.device.type == "cpu" else torch.bfloat16
        else:
            self.dtype = DTYPES[dtype]
        self.backend = make_attention_backend(attention_backend, self.device)
        self.replicas: dict[str, DraftFollower] = {}

    def attach(self, replica: str, num_blocks: int, max_model_len: int) -> None:
        """A cache of ``num_blocks`` blocks for one target replica (replacing an earlier one
        of the same name: a rebuilt replica starts with an empty cache)."""
        from workers.speculative.draft_model import DraftModel

        draft = DraftModel(self.folder, self.dtype, self.device, self.backend, self.num_drafts,
                           self.block_size)
        draft.allocate(num_blocks)
        draft.build_rotary_table(max_model_len)
        if self.device.type == "cuda":
            draft.capture_graphs(max_num_seqs=256)
        self.replicas[replica] = DraftFollower(draft)

    def detach(self, replica: str) -> None:
        self.replicas.pop(replica, None)

    def draft(self, replica: str, rows: list[DraftRow], released: list[str]
              ) -> list[list[int]]:
        return self.replicas[replica].draft_rows(rows, released)


def draft_actor(folder: str, dtype: str, device: str, block_size: int, num_drafts: int,
                attention_backend: str, gpus: float):  # type: ignore[no-untyped-def]
    """The cluster's draft actor for this model and settings, created by the first replica
    that asks (``get_if_exists``), found by the others."""
    if not ray.is_initialized():
        init_ray()
    on_gpu = device.startswith("cuda")
    name = f"tandem-draft:{folder}:{dtype}:{block_size}:{num_drafts}"
    return ray.remote(DraftActor).options(
        # owned by the replica that created it: it goes when that replica's process does
        name=name, get_if_exists=True,
        num_gpus=gpus if on_gpu else 0, num_cpus=0 if on_gpu else 0.5,
        max_concurrency=1,  # steps of one replica stay in order; replicas take turns
    ).remote(folder, dtype, "cuda" if on_gpu else device, block_size, num_drafts,
             attention_backend)

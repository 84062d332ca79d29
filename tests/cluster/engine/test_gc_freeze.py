"""An engine freezes what its start-up built (workers/gc_freeze.py) and unfreezes on shutdown."""

import gc
import weakref

from cluster.engine.llm import LLM
from router.sampling_params import SamplingParams


def is_frozen(obj) -> bool:
    # gc.get_objects() lists the collector's generations, never the frozen objects
    return gc.is_tracked(obj) and not any(o is obj for o in gc.get_objects())


def test_start_up_objects_are_frozen_later_garbage_is_collected_and_shutdown_unfreezes(
    tiny_models,
):
    gc.unfreeze()
    llm = LLM(str(tiny_models["llama"]), device="cpu", block_size=4, num_kv_blocks=16)
    engine = llm.engine
    assert gc.get_freeze_count() > 0
    assert is_frozen(engine.scheduler) and is_frozen(engine.executor.worker.model)

    class Node:
        pass

    cycle = Node()
    cycle.self = cycle  # garbage only the cyclic collector frees
    ref = weakref.ref(cycle)
    del cycle
    gc.collect()
    assert ref() is None
    outputs = llm.generate([[1, 2, 3]], SamplingParams(temperature=0.0, max_tokens=4))
    assert len(outputs[0].outputs[0].token_ids) == 4  # serving goes on as before

    engine.shutdown()
    assert gc.get_freeze_count() == 0 and not is_frozen(engine.scheduler)

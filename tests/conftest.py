# Before anything imports Triton: on a machine without CUDA this sets TRITON_INTERPRET=1, which
# Triton reads once, when it and each kernel are defined (see tests/workers/triton_interpreter.py).
# Here, at the root, so that no test module of any folder imports Triton before it is set.
import tests.workers.triton_interpreter  # noqa: F401, I001

import pytest

from cluster import environment
from cluster.ray.start import init_ray
from tests import xdist_scheduling
from tests.cluster.cli import served_process
from tests.cluster.ray import nodes_background
from tests.gpus import skip_without_gpus
from tests.tiny_models import SPECS, build_tiny_chat_model, build_tiny_model

# Serve as `tandem serve` runs it (cluster/cli/serve.py): set before any module imports Ray
# Serve, which reads it once, and before the session's Ray starts, whose processes inherit it
environment.set_serve_throughput_optimized(None)
# and a Serve app that is deleted goes at once, as under `tandem serve` (whose drain comes
# first): no load balancer here needs Serve's 30 s of draining
environment.set_serve_quick_stop()


def pytest_configure(config):
    if config.pluginmanager.hasplugin("xdist"):  # its hook is unknown where xdist is not
        from tests.xdist_scheduling import XdistScheduling

        config.pluginmanager.register(XdistScheduling(), "tandem-xdist-scheduling")


@pytest.hookimpl(trylast=True)  # after -m deselects: GPUs are counted for GPU tests that run
def pytest_collection_modifyitems(items):
    skip_without_gpus(items)  # @pytest.mark.gpu(gpus=N) on fewer GPUs: skipped (tests/gpus.py)


def pytest_collection_finish(session):
    """What starts slowly and mostly waits (Ray nodes, a `tandem serve`) starts now and runs
    beside the tests collected before the ones that need it, in the worker that runs those."""
    if session.config.option.collectonly:
        return
    # under xdist every worker collects every test: the worker that runs them starts these
    if (any(item.nodeid.startswith(nodes_background.TEST_FILE) for item in session.items)
            and xdist_scheduling.runs_here(xdist_scheduling.NODES_SCOPE)):
        nodes_background.SCENARIO.start()
    if (any(served_process.FIXTURE in item.fixturenames for item in session.items)
            and xdist_scheduling.runs_here(xdist_scheduling.SERVED_SCOPE)):
        served_process.EARLY.start()


def pytest_sessionfinish(session):
    nodes_background.SCENARIO.stop()  # what the session ended before
    served_process.EARLY.stop()


@pytest.fixture(scope="session")
def tiny_models(tmp_path_factory):
    """name -> folder of a tiny random model (see tests/tiny_models.py)."""
    folder = tmp_path_factory.mktemp("tiny-models")
    return {name: build_tiny_model(name, folder) for name in SPECS}


@pytest.fixture(scope="session")
def tiny_chat_model(tmp_path_factory):
    """A tiny random model with the default model's tokenizer (pulled once into the cache)."""
    from cluster.engine.config import DEFAULT_MODEL
    from workers.catalog import resolve_model

    tokenizer_folder = resolve_model(DEFAULT_MODEL, environment.cache_dir())
    return build_tiny_chat_model(tmp_path_factory.mktemp("tiny-chat-model"), tokenizer_folder)


@pytest.fixture(scope="session")
def ray_session():
    """One local Ray instance for the whole test session (started on first use)."""
    import ray

    if not ray.is_initialized():
        # logical CPUs: tests place more one-CPU actors than this machine has cores
        init_ray(num_cpus=8, include_dashboard=False, log_to_driver=False)
    yield ray
    ray.shutdown()

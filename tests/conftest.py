import pytest

from tests.tiny_models import SPECS, build_tiny_model


@pytest.fixture(scope="session")
def tiny_models(tmp_path_factory):
    """name -> folder of a tiny random model (see tests/tiny_models.py)."""
    folder = tmp_path_factory.mktemp("tiny-models")
    return {name: build_tiny_model(name, folder) for name in SPECS}


@pytest.fixture(scope="session")
def ray_session():
    """One local Ray instance for the whole test session (started on first use)."""
    import ray

    if not ray.is_initialized():
        # logical CPUs: tests place more one-CPU actors than this machine has cores
        ray.init(num_cpus=8, include_dashboard=False, log_to_driver=False)
    yield ray
    ray.shutdown()

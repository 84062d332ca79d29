import pytest

from tests.tiny_models import SPECS, build_tiny_model


@pytest.fixture(scope="session")
def tiny_models(tmp_path_factory):
    """name -> folder of a tiny random model (see tests/tiny_models.py)."""
    folder = tmp_path_factory.mktemp("tiny-models")
    return {name: build_tiny_model(name, folder) for name in SPECS}

"""A model's config as a shard reads it: the attributes transformers resolved from config.json
(defaults filled in by its config class), handed over as a plain dict by the engine, which
read the folder already. A shard then never imports transformers, ~0.8 s of CPU at every
shard's start (a Ray actor in a process of its own)."""

from typing import Any


class ModelConfig:
    """Attribute access to a config's ``to_dict()``, as the model classes read a
    ``PretrainedConfig``."""

    def __init__(self, values: dict[str, Any]) -> None:
        self.__dict__.update(values)

    def to_dict(self) -> dict[str, Any]:
        return dict(self.__dict__)

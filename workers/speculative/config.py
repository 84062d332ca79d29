"""What ``speculative_config`` asks for, in vLLM's keys, checked once at start-up."""

from dataclasses import dataclass, fields
from typing import Any

MAX_SPECULATIVE_TOKENS = 8  # a verify step of 1 + 8 tokens a row; more rarely pays
METHODS = ("ngram", "draft_model", "eagle", "eagle3")
HEAD_METHODS = ("eagle", "eagle3")  # a head over the target's own features


@dataclass(frozen=True)
class SpeculativeConfig:
    method: str = "ngram"  # ngram (prompt lookup) | draft_model | eagle | eagle3
    num_speculative_tokens: int = 4  # the most draft tokens a row verifies in one step
    prompt_lookup_min: int = 1  # ngram: the shortest suffix that may match
    prompt_lookup_max: int = 4  # ngram: the longest
    model: str | None = None  # draft_model: a catalog name or a folder
    draft_tensor_parallel_size: int = 1
    placement: str = "worker"  # worker (the target's, rank 0's device) | actor (its own)
    draft_gpus: float = 1.0  # placement actor: the share of a GPU the draft actor asks for
    adaptive: bool = True

    def __post_init__(self) -> None:
        k = self.num_speculative_tokens
        checks = [
            (self.method in METHODS,
             f"speculative method must be one of {', '.join(METHODS)}, got {self.method!r}"),
            (1 <= k <= MAX_SPECULATIVE_TOKENS,
             f"num_speculative_tokens must be in [1, {MAX_SPECULATIVE_TOKENS}], got {k}"),
            (self.prompt_lookup_min >= 1,
             f"prompt_lookup_min must be at least 1, got {self.prompt_lookup_min}"),
            (self.prompt_lookup_max >= self.prompt_lookup_min,
             f"prompt_lookup_max ({self.prompt_lookup_max}) must be at least prompt_lookup_min "
             f"({self.prompt_lookup_min})"),
            (self.placement in ("worker", "actor"),
             f"placement must be 'worker' or 'actor', got {self.placement!r}"),
            (self.method not in ("draft_model", *HEAD_METHODS) or self.model is not None,
             f"method {self.method!r} needs a draft 'model'"),
            (self.method not in HEAD_METHODS or self.placement == "worker",
             f"method {self.method!r} drafts from the target's own hidden states: placement "
             "'worker' only"),
            (0 < self.draft_gpus <= 1,
             f"draft_gpus must be in (0, 1] (a GPU or a share of one), got {self.draft_gpus}"),
            # said plainly rather than ignored
            (self.draft_tensor_parallel_size == 1,
             "draft_tensor_parallel_size above 1 is not built yet (a draft runs on one device, "
             f"in the worker or in its actor), got {self.draft_tensor_parallel_size}"),
        ]
        for ok, message in checks:
            if not ok:
                raise ValueError(message)

    @classmethod
    def from_dict(cls, values: dict[str, Any]) -> "SpeculativeConfig":
        """vLLM's ``speculative_config``: a draft ``model`` without a ``method`` is a draft
        model; unknown keys are refused by name."""
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(values) - known)
        if unknown:
            raise ValueError(f"unknown speculative_config keys: {', '.join(unknown)} (known: "
                             f"{', '.join(sorted(known))})")
        values = dict(values)
        if "method" not in values:
            values["method"] = method_from_name(values.get("model"))
        return cls(**values)

    @property
    def uses_head(self) -> bool:
        return self.method in HEAD_METHODS


def method_from_name(model: str | None) -> str:
    """Where no method is named: a folder holding an EAGLE head is one (its checkpoint says
    which); otherwise vLLM's guess, a model whose name says eagle3 or eagle is such a head,
    another a draft model; no model, prompt lookup."""
    if not model:
        return "ngram"
    from pathlib import Path

    from workers.speculative.eagle.head_config import head_method_in

    if Path(model).is_dir() and (found := head_method_in(Path(model))) is not None:
        return found
    name = model.rstrip("/").rsplit("/", 1)[-1].lower()
    if "eagle3" in name:
        return "eagle3"
    return "eagle" if "eagle" in name else "draft_model"

"""One request's timing as a load sees it: when it was sent, when each chunk of output came,
when it ended. The load runners write it; the reports (``vllm_results``) read it."""

from dataclasses import dataclass, field


@dataclass
class Timing:
    start: float
    chunk_times: list[float] = field(default_factory=list)  # when output arrived
    end: float = 0.0
    output_tokens: int = 0

    @property
    def ttft(self) -> float:
        return self.chunk_times[0] - self.start

    @property
    def tpot(self) -> float | None:
        if self.output_tokens < 2:
            return None
        return (self.end - self.chunk_times[0]) / (self.output_tokens - 1)

    @property
    def itls(self) -> list[float]:
        return [b - a for a, b in zip(self.chunk_times, self.chunk_times[1:], strict=False)]

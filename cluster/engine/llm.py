"""The offline API: a batch of prompts in, their completions out.

    from cluster import LLM, SamplingParams
    llm = LLM(model="smollm2-135m-instruct", dtype="float32", device="cpu")
    outs = llm.generate(["Hello"], SamplingParams(temperature=0.0, max_tokens=32))
"""

from collections.abc import Sequence

from tqdm import tqdm

from cluster.engine.config import DEFAULT_MODEL, EngineConfig
from cluster.engine.llm_engine import LLMEngine, Prompt
from cluster.engine.outputs import EngineStats, RequestOutput
from cluster.engine.tokenizer import Message
from router.sampling_params import SamplingParams


def as_prompt_list(prompts: Prompt | Sequence[Prompt]) -> list[Prompt]:
    """A single prompt (a string, or one list of token ids) or a list of them."""
    if isinstance(prompts, str):
        return [prompts]
    prompts = list(prompts)
    if prompts and all(isinstance(token, int) for token in prompts):
        return [prompts]  # type: ignore[list-item]
    return prompts  # type: ignore[return-value]


class LLM:
    def __init__(self, model: str = DEFAULT_MODEL, **engine_args: object) -> None:
        self.engine = LLMEngine(EngineConfig(model=model, **engine_args))  # type: ignore[arg-type]

    def generate(
        self,
        prompts: Prompt | Sequence[Prompt],
        params: SamplingParams | Sequence[SamplingParams] | None = None,
        use_tqdm: bool = False,
    ) -> list[RequestOutput]:
        """One output per prompt, in order. A request the engine failed (it logs why) comes
        back finished, its completions aborted, with ``error`` saying so: the rest of the
        batch is not lost with it."""
        prompt_list = as_prompt_list(prompts)
        params_list = self._params_for(len(prompt_list), params)
        # tokenize and check everything first: one bad prompt rejects the batch, changing nothing
        token_lists = [self.engine.tokenize(p) for p in prompt_list]
        for token_ids in token_lists:
            self.engine.check_prompt(token_ids)
        request_ids = [
            self.engine.add_request(p, sp) for p, sp in zip(prompt_list, params_list, strict=True)
        ]
        return self._run(request_ids, use_tqdm)

    def chat(
        self,
        conversations: list[Message] | Sequence[list[Message]],
        params: SamplingParams | Sequence[SamplingParams] | None = None,
        use_tqdm: bool = False,
    ) -> list[RequestOutput]:
        """Applies the model's chat template to each conversation, then generates."""
        if conversations and isinstance(conversations[0], dict):
            conversations = [conversations]  # type: ignore[list-item]
        prompts = [self.engine.chat_prompt(list(c)) for c in conversations]  # type: ignore[arg-type]
        return self.generate(prompts, params, use_tqdm)

    def stats(self) -> EngineStats:
        return self.engine.stats()

    @staticmethod
    def _params_for(
        count: int, params: SamplingParams | Sequence[SamplingParams] | None
    ) -> list[SamplingParams]:
        if params is None:
            return [SamplingParams()] * count
        if isinstance(params, SamplingParams):
            return [params] * count
        if len(params) != count:
            raise ValueError(f"got {len(params)} sampling params for {count} prompts")
        return list(params)

    def _run(self, request_ids: list[str], use_tqdm: bool) -> list[RequestOutput]:
        done: dict[str, RequestOutput] = {}
        pending = set(request_ids)
        with tqdm(total=len(request_ids), disable=not use_tqdm, desc="generating") as bar:
            while pending:
                for output in self.engine.step(only_finished=True):
                    if output.finished and output.request_id in pending:
                        done[output.request_id] = output
                        pending.discard(output.request_id)
                        bar.update(1)
        return [done[request_id] for request_id in request_ids]

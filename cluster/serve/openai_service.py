"""The OpenAI API over a cluster: requests in, responses or event streams out. No HTTP here.

Everything a request could get wrong is found before anything is queued, and raised as an
``APIError`` (a 4xx); a request that reaches the cluster is aborted there when its stream
is closed early.
"""

from collections.abc import AsyncIterator, Sized
from dataclasses import dataclass, field, replace

from transformers import PreTrainedTokenizerBase

from cluster.engine.outputs import RequestOutput, part_ids
from cluster.engine.tokenizer import apply_chat_template
from cluster.serve.deadlines import bounded
from cluster.serve.failures import as_api_error, client_message
from cluster.serve.openai_errors import bad_request, model_not_found
from cluster.serve.openai_format import chat_choices, completion_choices, usage
from cluster.serve.openai_stream import StreamContext, chat_events, completion_events
from cluster.serve.protocol import (
    ChatCompletionRequest,
    ChatCompletionResponse,
    CompletionRequest,
    CompletionResponse,
    ModelCard,
    ModelList,
    Prompt,
    SamplingFields,
    new_id,
    now,
)
from cluster.serve.request_streams import Cluster, final_outputs, merge_streams, prefetch
from cluster.serve.structured_fields import engine_error_param, output_constraint, token_biases
from cluster.serve.text_fields import check_utf8
from cluster.serve.tool_fields import tool_request
from router.sampling_params import SamplingParams
from router.structured_outputs import StructuredOutputs

Events = AsyncIterator[str]
Stream = AsyncIterator[tuple[int, RequestOutput]]


@dataclass(frozen=True)
class Constraints:
    """What a request asks of its output's tokens, mapped once for all its prompts."""

    structured: StructuredOutputs | None = None
    source: str | None = None  # the field the constraint came from, which a 400 names
    logit_bias: dict[int, float] | None = None


@dataclass
class OpenAIService:
    cluster: Cluster
    tokenizer: PreTrainedTokenizerBase | None
    model_name: str
    created: int = field(default_factory=now)  # the model card's: when this server started

    def models(self) -> ModelList:
        return ModelList(data=[self.model(self.model_name)])

    def model(self, name: str) -> ModelCard:
        self._check_model(name)
        return ModelCard(id=self.model_name, created=self.created,
                         max_model_len=self.cluster.max_model_len)

    async def completions(self, request: CompletionRequest,
                          deadline: float | None = None) -> CompletionResponse | Events:
        """``deadline``: the ``time.monotonic()`` it must end by (deadlines.py), or None."""
        check_utf8(request)  # first: every later message may quote the request's strings
        self._check_model(request.model)
        self._check_unsupported(request)
        if request.echo and request.logprobs is not None:
            raise bad_request("echo with logprobs is not supported (no prompt logprobs)", "echo",
                              code="unsupported_value")
        prompts = self._completion_prompts(request.prompt)
        if request.echo:
            self._check_echo(request.prompt)
        constraints = self._constraints(request)  # once: a schema compiles once, not per prompt
        params = [self._params(request, request.max_tokens, "max_tokens", request.logprobs, ids,
                               "prompt", constraints) for ids in prompts]
        request_id = new_id("cmpl")
        stream = await self._start(request_id, prompts, params, deadline, constraints.source)
        echoes = None
        if request.echo:  # decoded once the engine has found the ids in its vocabulary: the
            try:  # tokenizer overflows on others (a negative one), a 500
                echoes = self._echoes(request.prompt, prompts)
            except BaseException:
                await stream.aclose()  # type: ignore[attr-defined]
                raise
        if request.stream:
            context = self._context(request_id, request, prompts)
            return completion_events(stream, replace(context, echoes=echoes))
        outputs = await self._finish(stream, len(prompts))
        return CompletionResponse(
            id=request_id, model=self.model_name, usage=usage(prompts, outputs),
            choices=completion_choices(self.tokenizer, outputs, request.n, echoes),
        )

    async def chat(self, request: ChatCompletionRequest,
                   deadline: float | None = None) -> ChatCompletionResponse | Events:
        check_utf8(request)
        self._check_model(request.model)
        self._check_unsupported(request)
        if not request.messages:
            raise bad_request("messages must not be empty: send at least one message",
                              "messages", code="empty_messages")
        constraints = self._constraints(request)
        tools = tool_request(request, constraints.source)
        if tools.constraint is not None:
            constraints = replace(constraints, structured=tools.constraint, source="tools")
        try:
            ids = apply_chat_template(self.tokenizer,
                                      [m.as_template_message() for m in request.messages],
                                      tools.tools or None)
        except ValueError as error:
            raise bad_request(str(error), "messages", code="invalid_messages") from error
        limit_name = "max_tokens" if request.max_completion_tokens is None \
            else "max_completion_tokens"
        params = self._params(request, request.max_new_tokens, limit_name, request.num_logprobs,
                              ids, "messages", constraints)
        request_id = new_id("chatcmpl")
        stream = await self._start(request_id, [ids], [params], deadline, constraints.source)
        if request.stream:
            context = self._context(request_id, request, [ids])
            return chat_events(stream, replace(context, tool_calls=tools.parses_calls))
        outputs = await self._finish(stream, 1)
        return ChatCompletionResponse(
            id=request_id, model=self.model_name, usage=usage([ids], outputs),
            choices=chat_choices(self.tokenizer, outputs[0], tools.parses_calls),
        )

    # -- checks -------------------------------------------------------------------------------

    def _check_model(self, name: str | None) -> None:
        if name is not None and name != self.model_name:
            raise model_not_found(name)

    def _check_unsupported(self, request: SamplingFields) -> None:
        """Options vLLM clients send that tandem does not do: a clear 400, never ignored."""
        if request.best_of is not None and request.best_of != request.n:
            raise bad_request(f"best_of is not supported (got {request.best_of} with n = "
                              f"{request.n}): leave it out or make it equal to n", "best_of",
                              code="unsupported_value")

    def _constraints(self, request: SamplingFields) -> Constraints:
        """The request's structured output and logit bias, each 400 naming the field the
        client used; token ids checked against the tokenizer's vocabulary when there is one."""
        structured, source = output_constraint(request)
        vocab = len(self.tokenizer) if isinstance(self.tokenizer, Sized) else None
        return Constraints(structured, source, token_biases(request.logit_bias, vocab))

    def _check_echo(self, prompt: Prompt) -> None:
        if self.tokenizer is None and not all(isinstance(p, str) for p in prompt_items(prompt)):
            raise bad_request("echo of token-id prompts needs the model's tokenizer", "echo",
                              code="unsupported_value")

    def _echoes(self, prompt: Prompt, prompts: list[list[int]]) -> list[str]:
        """Each prompt's text, as given, or decoded from its token ids."""
        return [p if isinstance(p, str) else str(self.tokenizer.decode(ids))  # type: ignore[union-attr]
                for p, ids in zip(prompt_items(prompt), prompts, strict=True)]

    def _completion_prompts(self, prompt: Prompt) -> list[list[int]]:
        items = prompt_items(prompt)
        if not items:
            raise bad_request("prompt must not be empty: send at least one prompt", "prompt",
                              code="empty_prompt")
        prompts = [self._tokenize(p) for p in items]
        if not all(prompts):
            raise bad_request("prompt is empty: a prompt must have at least one token",
                              "prompt", code="empty_prompt")
        return prompts

    def _tokenize(self, prompt: str | list[int]) -> list[int]:
        if not isinstance(prompt, str):
            return list(prompt)
        if self.tokenizer is None:
            raise bad_request("this model has no tokenizer: send prompts as token ids",
                              "prompt", code="unsupported_value")
        return list(self.tokenizer.encode(prompt))

    def _params(self, request: SamplingFields, max_tokens: int | None, limit_name: str,
                logprobs: int | None, prompt_ids: list[int], param: str,
                constraints: Constraints) -> SamplingParams:
        """``limit_name``: the field ``max_tokens`` came from, which a 400 names."""
        context = self.cluster.max_model_len
        room = context - len(prompt_ids)
        if room <= 0:
            raise bad_request(
                f"This model's maximum context length is {context} tokens, and the prompt has "
                f"{len(prompt_ids)}: no room is left to generate.", param,
                code="context_length_exceeded")
        try:
            params = request.sampling_params(room if max_tokens is None else max_tokens,
                                             logprobs, constraints.structured,
                                             constraints.logit_bias)
        except ValueError as error:
            name = str(error).split(" ", 1)[0]
            raise bad_request(str(error), name if name.isidentifier() else None,
                              code="invalid_value") from error
        if params.max_tokens > room:  # vLLM's words; the engine would cut it short silently
            raise bad_request(
                f"'{limit_name}' is too large: {params.max_tokens}. This model's maximum "
                f"context length is {context} tokens and your request has {len(prompt_ids)} "
                f"input tokens ({params.max_tokens} > {context} - {len(prompt_ids)}).",
                limit_name, code="context_length_exceeded")
        return params

    # -- running ------------------------------------------------------------------------------

    async def _start(self, request_id: str, prompts: list[list[int]],
                     params: list[SamplingParams], deadline: float | None,
                     constraint_param: str | None = None) -> Stream:
        """Starts one cluster request per prompt and waits for the first output, so an error
        the engine finds in a prompt becomes a 400 before any response is sent (naming
        logit_bias or ``constraint_param``, the constraint's field, when it is about them)."""
        ids = part_ids(request_id, len(prompts))
        streams = [self.cluster.generate(p, sp, rid)
                   for p, sp, rid in zip(prompts, params, ids, strict=True)]
        try:
            return await prefetch(bounded(merge_streams(streams), deadline))
        except Exception as error:  # the engine's prompt checks: a 400; else the server's
            param = engine_error_param(client_message(error), constraint_param)
            raise as_api_error(error, param) from error

    async def _finish(self, stream: Stream, count: int) -> list[RequestOutput]:
        try:
            return await final_outputs(stream, count)
        except Exception as error:
            raise as_api_error(error, "prompt") from error

    def _context(self, request_id: str, request: SamplingFields,
                 prompts: list[list[int]]) -> StreamContext:
        return StreamContext(request_id, self.model_name, self.tokenizer, prompts, request.n,
                             request.include_usage, request.continuous_usage)


def prompt_items(prompt: Prompt) -> list[str | list[int]]:
    """A completions request's prompts: one string or token list, or a list of them."""
    single = isinstance(prompt, str) or (prompt and isinstance(prompt[0], int))
    return [prompt] if single else list(prompt)  # type: ignore[arg-type,list-item]

"""The OpenAI-compatible HTTP protocol: request and response bodies as pydantic models.

Pydantic checks shapes and types only. Ranges are checked once, by ``SamplingParams``, so an
out-of-range value gets the same message over HTTP as in the offline API. A field a body
does not declare is refused (unsupported_fields.py says how it is named).
"""

import time
import uuid
from typing import Any, ClassVar, Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

from cluster.serve.unsupported_fields import MESSAGE_FIELDS, REQUEST_FIELDS, without_empty
from router.sampling_params import SamplingParams
from router.structured_outputs import StructuredOutputs

Prompt = str | list[int] | list[str] | list[list[int]]


class RequestPart(BaseModel):
    """A request body or a part of one: fields it does not declare are refused, except the
    known ones in ``ignorable`` that ask for nothing (null, empty, or tandem's own way)."""

    model_config = ConfigDict(extra="forbid")
    ignorable: ClassVar[frozenset[str]] = frozenset()

    @model_validator(mode="before")
    @classmethod
    def _drop_ignorable(cls, data: Any) -> Any:
        # a declared field keeps its own validation (completions' echo is one of vLLM's names)
        return without_empty(data, cls.ignorable - cls.model_fields.keys())


class StreamOptions(RequestPart):
    include_usage: bool = Field(False, description="Send a final chunk carrying `usage`.")
    continuous_usage_stats: bool = Field(False, description="Every chunk carries `usage` so "
                                         "far (vLLM's option; guidellm sends it).")


class StructuredOutputsField(RequestPart):
    """vLLM's ``structured_outputs``: one constraint (structured_fields.py maps it)."""

    # "json" would shadow BaseModel.json: the field's name is its alias
    json_: dict[str, Any] | str | None = Field(None, alias="json",
                                               description="A JSON schema to match.")
    regex: str | None = Field(None, description="A regular expression to match.")
    choice: list[str] | None = Field(None, description="The output is one of these.")
    grammar: str | None = Field(None, description="An EBNF grammar (xgrammar's dialect).")
    json_object: bool | None = Field(None, description="Any JSON object.")
    disable_any_whitespace: bool = Field(False, description="Accepted: tandem never puts "
                                         "free whitespace between JSON tokens.")


class SamplingFields(RequestPart):
    """Fields shared by completions and chat completions."""

    ignorable = REQUEST_FIELDS

    model: str | None = Field(None, description="The served model's name (see /v1/models).")
    temperature: float = Field(1.0, description="0 is greedy; higher is more random.")
    top_p: float = Field(1.0, description="Nucleus sampling: keep the top tokens of this mass.")
    top_k: int = Field(0, description="Keep the k most likely tokens; 0 or -1 keeps all.")
    min_p: float = Field(0.0, description="Drop tokens less likely than min_p x the top one.")
    presence_penalty: float = Field(0.0, description="In [-2, 2]: penalize seen tokens once.")
    frequency_penalty: float = Field(0.0, description="In [-2, 2]: penalize by count seen.")
    repetition_penalty: float = Field(1.0, description="> 0; above 1 discourages repeats.")
    seed: int | None = Field(None, description="Makes sampling reproducible.")
    stop: str | list[str] | None = Field(None, description="Strings that end generation; "
                                         "they are not included in the output.")
    stop_token_ids: list[int] | None = Field(None, description="Token ids that end generation.")
    n: int = Field(1, description="Completions to generate for each prompt.")
    ignore_eos: bool = Field(False, description="Keep generating past end-of-sequence tokens.")
    min_tokens: int = Field(0, description="Tokens to generate at least: until then EOS, stop "
                            "tokens and stop strings do not end generation.")
    stream: bool = Field(False, description="Send tokens as server-sent events.")
    stream_options: StreamOptions | None = Field(None, description="Streaming options.")
    user: str | None = Field(None, description="An end-user id (recorded, not used).")
    best_of: int | None = Field(None, description="Not supported beyond n: null or equal to n.")
    response_format: dict[str, Any] | None = Field(None, description="{\"type\": \"text\"}, "
                                                   "{\"type\": \"json_object\"} or {\"type\": "
                                                   "\"json_schema\", \"json_schema\": {\"name\": "
                                                   "..., \"schema\": {...}}}.")
    structured_outputs: StructuredOutputsField | None = Field(
        None, description="vLLM's constraint: one of json, regex, choice, grammar, "
        "json_object.")
    guided_json: dict[str, Any] | str | None = Field(None, description="vLLM's older "
                                                     "structured_outputs.json.")
    guided_regex: str | None = Field(None, description="vLLM's older structured_outputs.regex.")
    guided_choice: list[str] | None = Field(None, description="vLLM's older "
                                            "structured_outputs.choice.")
    guided_grammar: str | None = Field(None, description="vLLM's older "
                                       "structured_outputs.grammar.")
    guided_decoding_backend: str | None = Field(None, description="Only 'xgrammar' or 'auto'.")
    logit_bias: dict[str, float] | None = Field(None, description="Token id (as a string) -> "
                                                "a bias in [-100, 100] added to its logit.")
    cache_salt: str | None = Field(None, min_length=1, description="Requests share cached "
                                   "prefixes only with requests of the same salt (one tenant's "
                                   "prefixes are not another's).")

    @property
    def include_usage(self) -> bool:
        return self.stream_options is not None and self.stream_options.include_usage

    @property
    def continuous_usage(self) -> bool:
        return self.stream_options is not None and self.stream_options.continuous_usage_stats

    def sampling_params(self, max_tokens: int, logprobs: int | None,
                        structured: StructuredOutputs | None = None,
                        logit_bias: dict[int, float] | None = None) -> SamplingParams:
        """Raises ValueError with SamplingParams' message for out-of-range values.
        ``structured`` and ``logit_bias``: the fields structured_fields.py maps (with the
        400s that name the field the client used), passed in already mapped."""
        return SamplingParams(
            n=self.n, max_tokens=max_tokens, temperature=self.temperature, top_p=self.top_p,
            top_k=self.top_k, min_p=self.min_p, repetition_penalty=self.repetition_penalty,
            presence_penalty=self.presence_penalty, frequency_penalty=self.frequency_penalty,
            seed=self.seed, stop=stop_strings(self.stop),
            stop_token_ids=tuple(self.stop_token_ids or ()),
            ignore_eos=self.ignore_eos, logprobs=logprobs, cache_salt=self.cache_salt,
            min_tokens=self.min_tokens, structured_outputs=structured, logit_bias=logit_bias,
        )


def stop_strings(stop: str | list[str] | None) -> tuple[str, ...]:
    return (stop,) if isinstance(stop, str) else tuple(stop or ())


class CompletionRequest(SamplingFields):
    prompt: Prompt = Field(description="A string, a list of token ids, or a list of either.")
    max_tokens: int | None = Field(16, description="Tokens to generate at most; "
                                   "null: as many as the context allows.")
    logprobs: int | None = Field(None, description="Return the top-n logprobs of each token.")
    echo: bool = Field(False, description="Send the prompt's text back before the completion "
                       "(not with logprobs).")


class TextPart(RequestPart):
    type: Literal["text"] = Field(description="Only text parts are supported.")
    text: str = Field(description="The part's text.")


class CalledFunction(RequestPart):
    name: str = Field(description="The function's name.")
    arguments: str = Field(description="Its arguments: a JSON object's text.")


class ToolCallIn(RequestPart):
    """A call an assistant message of the conversation made."""

    id: str = Field(description="The call's id, which the tool's answer names.")
    type: Literal["function"] = Field("function", description="Only functions.")
    function: CalledFunction


class ChatMessage(RequestPart):
    ignorable = MESSAGE_FIELDS

    role: Literal["system", "user", "assistant", "tool", "developer"] = Field(
        description="Who wrote the message.")
    content: str | list[TextPart] | None = Field(None, description="The message's text.")
    tool_calls: list[ToolCallIn] | None = Field(None, description="An assistant's calls.")
    tool_call_id: str | None = Field(None, description="A tool message: the call it answers.")

    def as_template_message(self) -> dict[str, Any]:
        content = self.content if isinstance(self.content, str) else "".join(
            part.text for part in self.content or [])
        message: dict[str, Any] = {"role": "system" if self.role == "developer" else self.role,
                                   "content": content}
        if self.tool_calls:
            message["tool_calls"] = [call.model_dump() for call in self.tool_calls]
        if self.tool_call_id is not None:
            message["tool_call_id"] = self.tool_call_id
        return message


class FunctionSpec(RequestPart):
    name: str = Field(description="The function's name.")
    description: str | None = Field(None, description="What it does, for the model.")
    parameters: dict[str, Any] | None = Field(None, description="Its arguments' JSON schema.")
    strict: bool | None = Field(None, description="Accepted: arguments always match the "
                                "schema.")


class ToolSpec(RequestPart):
    type: Literal["function"] = Field(description="Only functions.")
    function: FunctionSpec


class NamedFunction(RequestPart):
    name: str


class NamedToolChoice(RequestPart):
    type: Literal["function"]
    function: NamedFunction


class ChatCompletionRequest(SamplingFields):
    messages: list[ChatMessage] = Field(description="The conversation so far.")
    max_tokens: int | None = Field(None, description="Deprecated alias of "
                                   "max_completion_tokens.")
    max_completion_tokens: int | None = Field(None, description="Tokens to generate at most; "
                                              "null: as many as the context allows.")
    logprobs: bool = Field(False, description="Return the logprob of each generated token.")
    top_logprobs: int | None = Field(None, description="With logprobs: the top-n alternatives "
                                     "at each position, in [0, 20].")
    tools: list[ToolSpec] | None = Field(None, description="Functions the model may call.")
    tool_choice: Literal["none", "auto", "required"] | NamedToolChoice | None = Field(
        None, description="none, auto (the default with tools), required, or {\"type\": "
        "\"function\", \"function\": {\"name\": ...}}.")
    parallel_tool_calls: bool = Field(True, description="false: at most one call.")

    @property
    def max_new_tokens(self) -> int | None:
        return self.max_completion_tokens if self.max_completion_tokens is not None \
            else self.max_tokens

    @property
    def num_logprobs(self) -> int | None:
        return (self.top_logprobs or 0) if self.logprobs else None


# -- responses --------------------------------------------------------------------------------


def new_id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex}"


def now() -> int:
    return int(time.time())


class Usage(BaseModel):
    prompt_tokens: int = Field(description="Tokens in the prompt(s).")
    completion_tokens: int = Field(description="Tokens generated, over all choices.")
    total_tokens: int = Field(description="prompt_tokens + completion_tokens.")


class CompletionLogprobs(BaseModel):
    tokens: list[str] = Field(default_factory=list)
    token_logprobs: list[float] = Field(default_factory=list)
    top_logprobs: list[dict[str, float]] = Field(default_factory=list)
    text_offset: list[int] = Field(default_factory=list)


class CompletionChoice(BaseModel):
    index: int
    text: str
    logprobs: CompletionLogprobs | None = None
    finish_reason: str | None = Field(None, description="stop, length or abort.")
    stop_reason: int | str | None = Field(None, description="The stop string or token id.")


class CompletionResponse(BaseModel):
    id: str
    object: Literal["text_completion"] = "text_completion"
    created: int = Field(default_factory=now)
    model: str
    choices: list[CompletionChoice]
    usage: Usage | None = None


class TopLogprob(BaseModel):
    token: str
    logprob: float
    bytes: list[int] | None = None


class TokenLogprob(TopLogprob):
    top_logprobs: list[TopLogprob] = Field(default_factory=list)


class ChatLogprobs(BaseModel):
    content: list[TokenLogprob] | None = None


class FunctionCall(BaseModel):
    name: str
    arguments: str = Field(description="A JSON object's text, as the model wrote it.")


class ToolCall(BaseModel):
    id: str
    type: Literal["function"] = "function"
    function: FunctionCall


class AssistantMessage(BaseModel):
    role: Literal["assistant"] = "assistant"
    content: str | None
    tool_calls: list[ToolCall] | None = None


class ChatChoice(BaseModel):
    index: int
    message: AssistantMessage
    logprobs: ChatLogprobs | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None


class ChatCompletionResponse(BaseModel):
    id: str
    object: Literal["chat.completion"] = "chat.completion"
    created: int = Field(default_factory=now)
    model: str
    choices: list[ChatChoice]
    usage: Usage | None = None


class DeltaFunction(BaseModel):
    name: str | None = None
    arguments: str | None = None


class DeltaToolCall(BaseModel):
    """A call's part in a chunk: its first carries id, type and name; the others add to
    its arguments. ``index`` tells the calls of a choice apart."""

    index: int
    id: str | None = None
    type: Literal["function"] | None = None
    function: DeltaFunction


class DeltaMessage(BaseModel):
    role: Literal["assistant"] | None = None
    content: str | None = None
    tool_calls: list[DeltaToolCall] | None = None


class ChatChunkChoice(BaseModel):
    index: int
    delta: DeltaMessage
    logprobs: ChatLogprobs | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None


class ChatCompletionChunk(BaseModel):
    id: str
    object: Literal["chat.completion.chunk"] = "chat.completion.chunk"
    created: int = Field(default_factory=now)
    model: str
    choices: list[ChatChunkChoice]
    usage: Usage | None = None


class ModelCard(BaseModel):
    id: str
    object: Literal["model"] = "model"
    created: int = Field(default_factory=now)
    owned_by: str = "tandem"
    max_model_len: int | None = None


class ModelList(BaseModel):
    object: Literal["list"] = "list"
    data: list[ModelCard]


class ErrorInfo(BaseModel):
    message: str
    type: str
    param: str | None = None
    code: str | int | None = None


class ErrorResponse(BaseModel):
    error: ErrorInfo

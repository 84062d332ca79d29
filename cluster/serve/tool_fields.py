"""A chat request's ``tools``, ``tool_choice`` and ``parallel_tool_calls``, as the engine
takes them: the functions the prompt offers, and the constraint (router/tool_calls.py) that
keeps the model's calls well formed. Every problem is a 400 naming the field."""

from dataclasses import dataclass

from cluster.serve.openai_errors import bad_request
from cluster.serve.protocol import ChatCompletionRequest
from cluster.serve.structured_fields import convertible
from router.structured_outputs import StructuredOutputs
from router.tool_calls import Tool, check_choice, check_tools, tool_call_constraint


@dataclass(frozen=True)
class ToolRequest:
    tools: list[Tool]  # offered in the prompt (none when tool_choice is "none")
    choice: str  # "none", "auto", "required" or a function's name
    constraint: StructuredOutputs | None

    @property
    def parses_calls(self) -> bool:
        """Whether the output is read for calls (with "none" it is all content)."""
        return self.constraint is not None


NO_TOOLS = ToolRequest([], "none", None)


def tool_request(request: ChatCompletionRequest, other_constraint: str | None) -> ToolRequest:
    """``other_constraint``: the field of the request's structured-output constraint, if
    it has one: a request whose calls are constrained cannot also constrain its text."""
    choice = chosen(request)
    if not request.tools:
        if choice not in ("none", "auto"):  # those two ask nothing without tools
            raise bad_request(f"tool_choice {choice!r} needs tools, and the request has none",
                              "tool_choice", code="invalid_value")
        return NO_TOOLS
    tools = [Tool(spec.function.name, spec.function.description,
                  spec.function.parameters if spec.function.parameters is not None
                  else {"type": "object", "properties": {}})
             for spec in request.tools]
    try:
        check_tools(tools)
    except ValueError as error:
        raise bad_request(str(error), "tools", code="invalid_value") from error
    try:
        check_choice(tools, choice)
    except ValueError as error:
        raise bad_request(str(error), "tool_choice", code="invalid_value") from error
    if choice == "none":
        return ToolRequest([], "none", None)
    if other_constraint is not None:
        raise bad_request(f"conflicting constraints: tools (with tool_choice {choice!r}) and "
                          f"{other_constraint} both constrain the output; send tool_choice "
                          "'none' or leave one out", other_constraint, code="invalid_value")
    constraint = tool_call_constraint(tools, choice, request.parallel_tool_calls)
    assert constraint is not None  # choice is not "none"
    try:
        convertible(constraint)
    except ValueError as error:  # a parameters schema the backend cannot build
        raise bad_request(str(error).replace("structured_outputs.structural_tag", "tools"),
                          "tools", code="invalid_value") from error
    return ToolRequest(tools, choice, constraint)


def chosen(request: ChatCompletionRequest) -> str:
    """OpenAI's default: "auto" with tools, "none" without."""
    choice = request.tool_choice
    if choice is None:
        return "auto" if request.tools else "none"
    return choice if isinstance(choice, str) else choice.function.name

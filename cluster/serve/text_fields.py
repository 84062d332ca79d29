"""Every string of a request must be UTF-8 text, checked before anything reads one.

JSON's ``\\u`` escapes let a client send a lone surrogate (``"x\\ud800y"``): Python's JSON
parser keeps it in a str, pydantic accepts it, and it fails only where the text is encoded —
in the tokenizer (a 500) or in the response that quotes it. Found here, it is a 400 that
names the field.
"""

from collections.abc import Iterator

from pydantic import BaseModel

from cluster.engine.tokenizer import check_text
from cluster.serve.openai_errors import bad_request
from cluster.serve.unsupported_fields import field_path

Loc = tuple[str | int, ...]  # a field's path: names and list indices


def check_utf8(request: BaseModel) -> None:
    for loc, text in strings(request, ()):
        try:
            check_text(text, field_path(loc))
        except ValueError as error:
            raise bad_request(str(error), str(loc[0]), code="invalid_text") from None


def strings(value: object, loc: Loc) -> Iterator[tuple[Loc, str]]:
    """(path, string) for each string in ``value``: fields, list items, keys and values."""
    if isinstance(value, str):
        yield loc, value
    elif isinstance(value, BaseModel):
        for name in type(value).model_fields:
            yield from strings(getattr(value, name), (*loc, name))
    elif isinstance(value, list | tuple):
        if value and isinstance(value[0], int):
            return  # token ids (validated lists are of one type): no need to walk 100k ints
        for index, item in enumerate(value):
            yield from strings(item, (*loc, index))
    elif isinstance(value, dict):
        for key, item in value.items():
            yield from strings(key, (*loc, str(key)))
            yield from strings(item, (*loc, str(key)))

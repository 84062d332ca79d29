"""Incremental detokenization: text grows token by token without re-decoding everything.

Byte-level BPE tokens can end in the middle of a UTF-8 character, and a token's text can
depend on its left neighbour (leading spaces). So each step decodes a short window twice —
``tokens[prefix:read]`` and ``tokens[prefix:]`` — and emits the difference once it no longer
ends in an incomplete character (U+FFFD). Special tokens never reach the text.
"""

from dataclasses import dataclass

from transformers import PreTrainedTokenizerBase

# prompt tokens that give the first output tokens their left context
CONTEXT_TOKENS = 5


@dataclass
class IncrementalDetokenizer:
    tokenizer: PreTrainedTokenizerBase
    special_ids: frozenset[int]
    token_ids: list[int]  # the prompt's last plain tokens, then the plain output tokens
    prefix_offset: int
    read_offset: int
    text: str = ""

    @classmethod
    def for_prompt(
        cls, tokenizer: PreTrainedTokenizerBase, prompt_ids: list[int]
    ) -> "IncrementalDetokenizer":
        special = frozenset(tokenizer.all_special_ids)
        context = [t for t in prompt_ids if t not in special][-CONTEXT_TOKENS:]
        return cls(tokenizer, special, context, 0, len(context))

    def add(self, token_id: int) -> str:
        """Appends one token; returns the text it completes (maybe empty)."""
        if token_id in self.special_ids:
            return ""
        self.token_ids.append(token_id)
        prefix_text = self.tokenizer.decode(self.token_ids[self.prefix_offset : self.read_offset])
        new_text = self.tokenizer.decode(self.token_ids[self.prefix_offset :])
        if len(new_text) <= len(prefix_text) or new_text.endswith("\ufffd"):
            return ""  # an incomplete character: wait for the next token
        delta = new_text[len(prefix_text) :]
        self.prefix_offset = self.read_offset
        self.read_offset = len(self.token_ids)
        self.text += delta
        return delta

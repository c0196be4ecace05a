"""Pivotal tuning's new tokens as the user writes them ("<p1>=red"): parsed and checked for syntax here, without
a tokenizer (this package never imports torch or transformers; the UI reads it). Whether a token is really new and
an init word is one token of the model's vocabulary is lora/pivotal.py's check, made before the model loads."""
from __future__ import annotations

import re
from dataclasses import dataclass

#: Characters a new token may not hold: whitespace and commas split prompts and captions into words and tags,
#: '.' splits A1111's `bundle_emb.<token>.<vector>` keys, and '=' separates the token from its init word.
FORBIDDEN = re.compile(r"[\s,.=]")


@dataclass(frozen=True)
class PivotalToken:
    """One new token: the word typed in prompts, the existing word its vectors start from, and (with
    num_vectors_per_token > 1) the added sub-tokens `<p1>_1`, `<p1>_2`, ... (diffusers' multi-vector convention,
    which its pipelines expand in prompts)."""

    token: str
    init_word: str

    def pieces(self, vectors: int) -> list[str]:
        return [self.token] + [f"{self.token}_{i}" for i in range(1, vectors)]


def parse_token(text: str) -> PivotalToken:
    """"<p1>=red" -> PivotalToken("<p1>", "red"); ValueError with the sentence's ending otherwise."""
    token, sep, init = (part.strip() for part in str(text).partition("="))
    if not sep or not token or not init:
        raise ValueError(f"'{text}' is not TOKEN=INIT_WORD; write the new token, '=', and an existing word its "
                         "embedding starts from, e.g. <p1>=red")
    if FORBIDDEN.search(token):
        raise ValueError(f"the token '{token}' holds a space, comma, '.' or '='; use one word such as <p1>")
    if token != token.lower():
        raise ValueError(f"the token '{token}' has capitals, which the CLIP tokenizer lowercases in prompts; write "
                         f"it as {token.lower()}")
    if FORBIDDEN.search(init):
        raise ValueError(f"the init word '{init}' is not one word; give one word such as red")
    return PivotalToken(token, init.lower())


def parse_tokens(values: list[str]) -> list[PivotalToken]:
    """Every entry parsed; a token named twice is refused (ValueError)."""
    tokens = [parse_token(v) for v in values]
    seen: set[str] = set()
    for t in tokens:
        if t.token in seen:
            raise ValueError(f"the token '{t.token}' is named twice; name each new token once")
        seen.add(t.token)
    return tokens


def multi_vector_clash(values: list[str], vectors: int) -> str | None:
    """The sentence when a token is also another token's extra vector ('<p1>_1' beside '<p1>' with 2 vectors)."""
    try:
        tokens = parse_tokens(values)
    except ValueError:
        return None  # the field's own check says what is wrong
    owner: dict[str, str] = {}
    for t in tokens:
        for piece in t.pieces(vectors)[1:]:
            owner[piece] = t.token
    for t in tokens:
        if t.token in owner:
            return (f"pivotal_tokens: {t.token} is also the extra vector {t.token} of {owner[t.token]} "
                    f"(num_vectors_per_token {vectors}); give it another name")
    return None

"""Quoting a library's exception inside one of our one-line errors.

A library's message can span lines, run to several sentences and end in advice that does not apply
(transformers: "You need to have sentencepiece or tiktoken installed ..." when the tokenizer files are
simply missing). Our error lines quote its first sentence whole, or, where that sentence alone is
longer than the limit, cut it at a word boundary with an ellipsis: never mid-word.
"""

from __future__ import annotations

import re

# a sentence ends at . ! or ? followed by whitespace and a capital letter ("config.json", "0.5", "(1)",
# "e.g. a" do not end one)
_SENTENCE_END = re.compile(r"(?<=[.!?])\s+(?=[A-Z])")


def first_sentence(text: str, limit: int = 300) -> str:
    """`text` on one line, its first sentence only; longer than `limit` characters, cut at the last
    word boundary before it and ended with an ellipsis."""
    flat = " ".join(str(text).split())
    sentence = _SENTENCE_END.split(flat, maxsplit=1)[0]
    if len(sentence) <= limit:
        return sentence
    cut = sentence[:limit + 1].rsplit(" ", 1)[0] if " " in sentence[:limit + 1] else sentence[:limit]
    return cut.rstrip(" ,;:-(") + " ..."


def quote_exception(e: BaseException, limit: int = 300) -> str:
    """`TypeName: first sentence` of an exception, for an error line's parenthesis."""
    text = first_sentence(str(e), limit)
    return f"{type(e).__name__}: {text}" if text else type(e).__name__

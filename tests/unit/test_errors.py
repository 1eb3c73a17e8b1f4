"""megatron_specrl/errors.py: a library's exception quoted in one of our error lines keeps its first
sentence whole, or ends with an ellipsis at a word boundary, never mid-word, and drops the advice
that follows it."""

from __future__ import annotations

from megatron_specrl.errors import first_sentence, quote_exception

# transformers 5.19's message for a directory with config.json and weights but no tokenizer files
TRANSFORMERS = ("Couldn't instantiate the backend tokenizer from one of: \n(1) a `tokenizers` library serialization "
                "file, \n(2) a slow tokenizer instance to convert or \n(3) an equivalent slow tokenizer class to "
                "instantiate and convert. \nYou need to have sentencepiece or tiktoken installed to convert a slow "
                "tokenizer to a fast one.")


def test_the_first_sentence_is_quoted_whole_without_the_install_advice():
    text = quote_exception(ValueError(TRANSFORMERS))
    assert text == ("ValueError: Couldn't instantiate the backend tokenizer from one of: (1) a `tokenizers` library "
                    "serialization file, (2) a slow tokenizer instance to convert or (3) an equivalent slow "
                    "tokenizer class to instantiate and convert.")
    assert "sentencepiece" not in text and "\n" not in text


def test_a_long_sentence_ends_with_an_ellipsis_at_a_word_boundary():
    words = [f"word{i}" for i in range(200)]
    long = " ".join(words) + "."
    cut = first_sentence(long, limit=100)
    assert cut.endswith(" ...") and len(cut) <= 104
    kept = cut[:-4].split(" ")
    assert kept == words[:len(kept)]          # whole words only: the last one is not cut
    assert first_sentence(TRANSFORMERS, limit=62) == "Couldn't instantiate the backend tokenizer from one of: (1) a ..."


def test_file_names_and_numbers_do_not_end_a_sentence():
    assert first_sentence("no file config.json in /a/b.c at 0.5 GB. Install foo.") == \
        "no file config.json in /a/b.c at 0.5 GB."
    assert quote_exception(OSError("")) == "OSError"

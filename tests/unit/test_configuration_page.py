"""docs/configuration.md is generated from the config schema: every key has a one-sentence description,
and the committed page is what `python -m megatron_specrl.config.docs` writes now."""

from megatron_specrl.config import RunConfig
from megatron_specrl.config import docs as config_docs
from megatron_specrl.config.hints import schema_keys


def test_every_config_key_has_a_description():
    assert config_docs.missing_descriptions() == []


def test_the_generator_sees_every_key():
    rows = {f"{sec}.{name}" if sec else name for sec, _, fields in config_docs.sections() for name, _ in fields}
    assert set(schema_keys(RunConfig)) <= rows


def test_the_page_is_what_the_generator_writes():
    assert config_docs.PAGE.read_text() == config_docs.render(), \
        "docs/configuration.md is stale: run python -m megatron_specrl.config.docs"


def test_a_key_without_a_description_is_found():
    from pydantic import BaseModel, Field

    class Sub(BaseModel):
        a: int = Field(1, description="An a.")
        b: int = 2

    class Top(BaseModel):
        sub: Sub = Field(default_factory=Sub, description="A section.")
        c: int = 3

    assert config_docs.missing_descriptions(Top) == ["c", "sub.b"]


def test_check_mode(tmp_path, capsys):
    page = tmp_path / "configuration.md"
    assert config_docs.main(["--out", str(page), "--check"]) == 1
    assert config_docs.main(["--out", str(page)]) == 0
    assert config_docs.main(["--out", str(page), "--check"]) == 0

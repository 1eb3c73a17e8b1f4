"""docs/configuration.md, generated from the config schema (config.RunConfig): a table per section
with each key's type, default and description (its pydantic Field description, the one place it is
written). `python -m megatron_specrl.config.docs` rewrites the page; `--check` exits 1 when the page
differs from what it would write (tests/unit/test_configuration_page.py does the same). A developer tool:
its default page is the checkout's; a wheel install has none and needs --out.
"""

from __future__ import annotations

import argparse
import sys
import typing
from pathlib import Path

from pydantic import BaseModel

from megatron_specrl.config import RunConfig
from megatron_specrl.shipped import CHECKOUT

PAGE = CHECKOUT / "docs" / "configuration.md" if CHECKOUT is not None else None

HEADER = """# Configuration

Every key of a recipe (`examples/*.yaml`) and of a `key=value` override, by section. Generated from the
config schema (`megatron_specrl/config/schema.py`) by `python -m megatron_specrl.config.docs`: edit the
`Field(description=...)` there, not this page. A name in brackets is verl's for the same setting
(`megatron_specrl/config/hints.py` hints it when a recipe uses it). Keys whose default is *unset*
are resolved when the run starts (`megatron-specrl train ... --dry-run` prints what they resolve to).
"""


def _is_model(annotation) -> bool:
    return isinstance(annotation, type) and issubclass(annotation, BaseModel)


def type_text(annotation) -> str:
    """A key's type as a recipe writes it: int, float | null, one of `a`, `b`."""
    origin, args = typing.get_origin(annotation), typing.get_args(annotation)
    if annotation is type(None):
        return "null"
    if origin is typing.Literal:
        return "one of " + ", ".join(f"`{a}`" for a in args)
    if origin in (typing.Union, getattr(__import__("types"), "UnionType", None)):
        return " | ".join(type_text(a) for a in args)
    if origin in (list, tuple, dict):
        name = {list: "list", tuple: "tuple", dict: "mapping"}[origin]
        inner = ", ".join("..." if a is Ellipsis else type_text(a) for a in args)
        return f"{name}[{inner}]" if inner else name
    if annotation is typing.Any:
        return "any"
    return getattr(annotation, "__name__", str(annotation))


def default_text(field) -> str:
    if field.is_required():
        return "required"
    value = field.get_default(call_default_factory=True)
    if value is None:
        return "*unset*"
    if isinstance(value, BaseModel):
        return "(section)"
    if isinstance(value, bool):
        return f"`{str(value).lower()}`"
    if isinstance(value, float):
        return f"`{value:.10g}`"
    if isinstance(value, tuple):
        value = list(value)
    return f"`{value}`"


def sections(model=RunConfig, prefix: str = "") -> list[tuple[str, type, list[tuple[str, object]]]]:
    """(dotted section, its model, its (key, field) rows), depth first; a nested model is a row of its
    parent and a section of its own."""
    rows = list(model.model_fields.items())
    out = [(prefix.rstrip("."), model, rows)]
    for name, field in rows:
        if _is_model(field.annotation):
            out += sections(field.annotation, f"{prefix}{name}.")
    return out


def missing_descriptions(model=RunConfig) -> list[str]:
    """Dotted keys whose Field has no description."""
    return [f"{sec + '.' if sec else ''}{name}" for sec, _, rows in sections(model) for name, f in rows
            if not (f.description or "").strip()]


def _cell(text: str) -> str:
    return " ".join(text.split()).replace("|", "\\|")


def render(model=RunConfig) -> str:
    lines = [HEADER]
    for sec, sub, rows in sections(model):
        lines.append(f"## `{sec}`" if sec else "## Top level")
        lines.append("")
        doc = (sub.__doc__ or "").strip() if sec else ""
        if doc:
            lines += [" ".join(doc.split()), ""]
        lines += ["| key | type | default | description |", "|---|---|---|---|"]
        for name, f in rows:
            key = f"{sec}.{name}" if sec else name
            kind = "section" if _is_model(f.annotation) else type_text(f.annotation)
            lines.append(f"| `{key}` | {_cell(kind)} | {_cell(default_text(f))} | {_cell(f.description or '')} |")
        lines.append("")
    return "\n".join(lines).rstrip() + "\n"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m megatron_specrl.config.docs", description=__doc__)
    ap.add_argument("--out", type=Path, default=PAGE, required=PAGE is None,
                    help="the page to write (default: the checkout's docs/configuration.md)")
    ap.add_argument("--check", action="store_true", help="exit 1 if the page is not what would be written")
    args = ap.parse_args(argv)
    missing = missing_descriptions()
    if missing:
        print(f"config keys without a description: {', '.join(missing)}", file=sys.stderr)
        return 1
    text = render()
    if args.check:
        same = args.out.is_file() and args.out.read_text() == text
        if not same:
            print(f"{args.out} is stale: run python -m megatron_specrl.config.docs", file=sys.stderr)
        return 0 if same else 1
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(text)
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""Prompt data sets: loading (synthetic, .jsonl, .parquet), a resumable loader, prompt rendering.

Every record gets a stable id, so rewards, logs, speculative caches and
checkpoints refer to the same prompt however the data is shuffled or reloaded.
Formats map common public layouts onto (prompt, answer):

  gsm8k  question / answer, final answer after '#### ', and verl's GSM8K parquet
         (prompt = chat messages, reward_model.ground_truth)
  math   MATH / DeepScaleR (problem + answer or a \\boxed{} solution) and verl's
         DAPO-Math-17k parquet (prompt = chat messages, reward_model.ground_truth)
  plain  prompt_key / answer_key as given
  auto   detected from the first row
"""

from __future__ import annotations

import hashlib
import json
import logging
import random
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, Iterator

from megatron_specrl.data import synthetic

log = logging.getLogger(__name__)

if TYPE_CHECKING:   # a type only: the config (via rewards) imports this module
    from megatron_specrl.config import DataConfig

# Offset between the synthetic train and eval seeds (any large constant works; it is part of the ids).
EVAL_SEED_OFFSET = 1_000_000


class DatasetError(ValueError):
    """A data file is missing, unreadable, or a row lacks a field; names file, row and field."""


class PromptTooLongError(DatasetError):
    """A rendered prompt is longer than data.max_prompt_len."""


@dataclass
class PromptRecord:
    id: str
    prompt: str                      # text of the (last) user turn
    answer: str                      # ground truth, as a string
    meta: dict = field(default_factory=dict)   # format, source, solution, messages (chat prompts), ...


# --------------------------------------------------------------------------- reading rows

def _read_rows(path: Path) -> Iterator[tuple[str, dict]]:
    """Yield (location, row) with a human location ('line 7' / 'row 6') for error messages."""
    if not path.is_file():
        raise DatasetError(f"data file not found: {path}")
    suffix = path.suffix.lower()
    if suffix in (".jsonl", ".json"):
        with open(path, "rb") as fh:
            for lineno, raw in enumerate(fh, 1):
                try:   # per line, so the error names it (a BOM on the first line is dropped)
                    line = raw.decode("utf-8-sig" if lineno == 1 else "utf-8")
                except UnicodeDecodeError as e:
                    raise DatasetError(f"{path}: line {lineno} is not valid UTF-8 (byte {raw[e.start]:#04x} at "
                                       f"offset {e.start} of the line); re-encode the file as UTF-8") from None
                if not line.strip():
                    continue
                try:
                    row = json.loads(line)
                except json.JSONDecodeError as e:
                    raise DatasetError(f"{path}: line {lineno} is not valid JSON: {e}") from None
                if not isinstance(row, dict):
                    raise DatasetError(f"{path}: line {lineno} is a {type(row).__name__}, not a JSON object")
                yield f"line {lineno}", row
    elif suffix == ".parquet":
        import pyarrow.parquet as pq

        try:
            batches = pq.ParquetFile(path).iter_batches(batch_size=4096)
        except Exception as e:  # pyarrow raises several types for corrupt files
            raise DatasetError(f"cannot read parquet file {path}: {e}") from None
        i = 0
        for batch in batches:
            for row in batch.to_pylist():
                yield f"row {i}", row
                i += 1
    else:
        raise DatasetError(f"unsupported data file {path}: expected .jsonl or .parquet "
                           f"(or data.source=synthetic)")


_MISSING = object()
_NUMBER_RE = re.compile(r"-?[\d,]*\.?\d+")


def _get(row: dict, key: str) -> Any:
    """row[key], where a dotted key walks nested mappings (reward_model.ground_truth)."""
    cur: Any = row
    for part in key.split("."):
        if not isinstance(cur, dict) or part not in cur or cur[part] is None:
            return _MISSING
        cur = cur[part]
    return cur


def _first(row: dict, keys: list[str]) -> tuple[str | None, Any]:
    for k in keys:
        v = _get(row, k)
        if v is not _MISSING:
            return k, v
    return None, _MISSING


# --------------------------------------------------------------------------- answer extraction

def last_boxed(text: str) -> str | None:
    """Content of the last \\boxed{...} (or \\fbox{...}), braces balanced; None when absent."""
    start = max(text.rfind("\\boxed"), text.rfind("\\fbox"))
    if start < 0:
        return None
    brace = text.find("{", start)
    if brace < 0:
        return None
    depth = 0
    for i in range(brace, len(text)):
        if text[i] == "{":
            depth += 1
        elif text[i] == "}":
            depth -= 1
            if depth == 0:
                return text[brace + 1: i].strip()
    return None


_GSM8K_FINAL_RE = re.compile(r"\s*(-)?\s*\$?\s*(\d[\d,]*(?:\.\d+)?|\.\d+)")


def gsm8k_final_answer(solution: str) -> str | None:
    """The number after the last '####': '#### 1,234' -> '1234', '#### $5' -> '5', '#### -3' -> '-3',
    '#### 42 apples' -> '42', '#### 7.' -> '7' (thousands separators, '$' and trailing units or text
    dropped). None without '####' or without a number right after it."""
    if "####" not in solution:
        return None
    m = _GSM8K_FINAL_RE.match(solution.rsplit("####", 1)[1])
    if m is None:
        return None
    return (m.group(1) or "") + m.group(2).replace(",", "")


# --------------------------------------------------------------------------- formats

def _is_messages(value: Any) -> bool:
    return isinstance(value, list) and bool(value) and all(isinstance(m, dict) and "content" in m for m in value)


def detect_format(row: dict) -> str:
    """Guess the layout from one row: gsm8k, math or plain."""
    answer = row.get("answer")
    if "question" in row and isinstance(answer, str) and "####" in answer:
        return "gsm8k"
    if "problem" in row or "reward_model" in row or _is_messages(row.get("prompt")):
        return "math"
    if isinstance(row.get("solution"), str) and "\\boxed" in row["solution"]:
        return "math"
    return "plain"


def _candidates(data_cfg: DataConfig, fmt: str) -> tuple[list[str], list[str]]:
    """Field names to try for (prompt, answer). Keys set explicitly in the config are used alone;
    left at their defaults, the format's conventional names are tried after them."""
    conventional = {
        "gsm8k": (["question"], ["answer", "reward_model.ground_truth"]),   # the latter: verl's gsm8k parquet
        "math": (["problem", "prompt", "question"], ["answer", "reward_model.ground_truth", "solution"]),
        "plain": ([], []),
    }[fmt]
    explicit = data_cfg.model_fields_set
    prompt_keys = [data_cfg.prompt_key] + ([] if "prompt_key" in explicit else conventional[0])
    answer_keys = [data_cfg.answer_key] + ([] if "answer_key" in explicit else conventional[1])
    dedup = lambda ks: list(dict.fromkeys(ks))  # noqa: E731
    return dedup(prompt_keys), dedup(answer_keys)


def _is_null(row: dict, key: str) -> bool:
    """Whether `key` (dotted) is there with a null value (what _get reads as missing)."""
    *parents, last = key.split(".")
    cur: Any = _get(row, ".".join(parents)) if parents else row
    return isinstance(cur, dict) and last in cur and cur[last] is None


def _missing(path: Path, where: str, what: str, keys: list[str], fmt: str, row: dict) -> DatasetError:
    names = " or ".join(repr(k) for k in keys)
    nulls = [k for k in keys if _is_null(row, k)]
    if nulls:
        return DatasetError(f"{path}: {where}: {what} field {nulls[0]!r} is null (format={fmt})")
    return DatasetError(f"{path}: {where}: missing {what} field {names} (format={fmt}); "
                        f"fields present: {sorted(row)}. Set data.prompt_key / data.answer_key / data.format.")


# The roles chat templates render: OpenAI's chat roles (HF templates take system / user / assistant /
# tool; "developer" and the legacy "function" are OpenAI's) and Llama 3.x's tool-result role "ipython".
CHAT_ROLES = ("system", "user", "assistant", "tool", "developer", "function", "ipython")


def _row_to_fields(row: dict, path: Path, where: str, fmt: str, data_cfg: DataConfig) -> tuple[str, str, dict]:
    """(prompt text, answer, meta) for one row of a known format."""
    prompt_keys, answer_keys = _candidates(data_cfg, fmt)
    pkey, prompt = _first(row, prompt_keys)
    if prompt is _MISSING:
        raise _missing(path, where, "prompt", prompt_keys, fmt, row)
    akey, answer = _first(row, answer_keys)
    if answer is _MISSING:
        raise _missing(path, where, "answer", answer_keys, fmt, row)

    meta: dict = {"format": fmt, "source": str(path)}
    if isinstance(prompt, list) and not _is_messages(prompt):   # a chat row gone wrong: say which message
        if not prompt:
            raise DatasetError(f"{path}: {where}: prompt field {pkey!r} is an empty list of chat messages")
        i, m = next((i, m) for i, m in enumerate(prompt) if not (isinstance(m, dict) and "content" in m))
        raise DatasetError(f"{path}: {where}: prompt field {pkey!r} message {i} "
                           + (f"has no 'content' (keys: {sorted(m)})" if isinstance(m, dict) else
                              f"is a {type(m).__name__}, expected a {{'role': ..., 'content': ...}} mapping"))
    if _is_messages(prompt):
        for i, m in enumerate(prompt):   # None or multimodal parts would reach the tokenizer mid-setup, unnamed
            if not isinstance(m["content"], str):
                raise DatasetError(f"{path}: {where}: prompt field {pkey!r} message {i} has content of type "
                                   f"{type(m['content']).__name__}, expected a string")
            if not isinstance(m.get("role", "user"), str):   # the chat template would fail on it mid-setup
                raise DatasetError(f"{path}: {where}: prompt field {pkey!r} message {i} has role of type "
                                   f"{type(m['role']).__name__}, expected a string")
            if m.get("role", "user") not in CHAT_ROLES:   # a typo ("usr") would render silently as another turn
                raise DatasetError(f"{path}: {where}: prompt field {pkey!r} message {i} has role {m['role']!r}, "
                                   f"expected one of {', '.join(CHAT_ROLES)}")
        meta["messages"] = [{"role": m.get("role", "user"), "content": m["content"]} for m in prompt]
        users = [m["content"] for m in prompt if m.get("role", "user") == "user"]
        prompt = users[-1] if users else prompt[-1]["content"]
    elif not isinstance(prompt, str):
        raise DatasetError(f"{path}: {where}: prompt field {pkey!r} is a {type(prompt).__name__}, "
                           f"expected a string or a list of chat messages")
    elif not prompt.strip():   # nothing to ask (and, without special tokens, an empty prompt for the engine)
        raise DatasetError(f"{path}: {where}: prompt field {pkey!r} is empty")
    if isinstance(answer, dict):   # e.g. data.answer_key=reward_model instead of reward_model.ground_truth
        raise DatasetError(f"{path}: {where}: answer field {akey!r} is a mapping (keys: {sorted(answer)}), "
                           "not an answer; point data.answer_key at the field inside it (a.b)")

    if fmt == "gsm8k" and isinstance(answer, str) and "####" in answer:
        meta["solution"] = answer
        answer = gsm8k_final_answer(answer)
        if answer is None:
            raise DatasetError(f"{path}: {where}: gsm8k answer field {akey!r} has no number after its last '####'")
    elif fmt == "gsm8k" and isinstance(answer, str) and not _NUMBER_RE.fullmatch(answer.strip()):
        raise DatasetError(f"{path}: {where}: gsm8k answer field {akey!r} has no '#### <number>' final answer")
    elif fmt == "math" and isinstance(answer, str) and "\\boxed" in answer:
        meta["solution"] = answer
        boxed = last_boxed(answer)
        if boxed is None:
            raise DatasetError(f"{path}: {where}: unbalanced \\boxed{{}} in answer field {akey!r}")
        answer = boxed
    elif fmt == "math" and akey == "solution":
        raise DatasetError(f"{path}: {where}: math solution field 'solution' has no \\boxed{{}} answer "
                           f"and no 'answer' field is present")
    if isinstance(answer, (list, tuple)):  # some sets store ground truths as a one-element list
        answer = answer[0] if len(answer) == 1 else json.dumps(answer)
    answer = str(answer).strip()
    if fmt == "math" and not answer:   # nothing to verify against: every response would score 0
        raise DatasetError(f"{path}: {where}: math answer field {akey!r} is empty")
    return prompt, answer, meta


# --------------------------------------------------------------------------- ids

def stable_id(prompt: Any, answer: str) -> str:
    """Content hash of (prompt, answer): the same row gets the same id in every run and order."""
    blob = json.dumps([prompt, answer], sort_keys=True, ensure_ascii=False)
    return "h-" + hashlib.sha256(blob.encode("utf-8")).hexdigest()[:16]


def _dedup_ids(records: list[PromptRecord]) -> list[PromptRecord]:
    """Repeated ids get '#1', '#2', ... in file order, so they stay unique and deterministic."""
    seen: dict[str, int] = {}
    for r in records:
        n = seen.get(r.id, 0)
        seen[r.id] = n + 1
        if n:
            r.id = f"{r.id}#{n}"
    return records


def file_format(path: str | Path, data_cfg: DataConfig) -> str:
    """The format load_file uses for this file: data.format, or the one detected from its first row."""
    if data_cfg.format != "auto":
        return data_cfg.format
    for _, row in _read_rows(Path(path)):
        return detect_format(row)
    raise DatasetError(f"data file {path} has no rows")


def load_file(path: str | Path, data_cfg: DataConfig) -> list[PromptRecord]:
    """All records of a .jsonl / .parquet file, mapped through data_cfg.format and field keys."""
    path = Path(path)
    fmt = data_cfg.format
    records = []
    for where, row in _read_rows(path):
        if fmt == "auto":
            fmt = detect_format(row)
        prompt, answer, meta = _row_to_fields(row, path, where, fmt, data_cfg)
        rid = _get(row, data_cfg.id_key) if data_cfg.id_key else _MISSING
        if rid is _MISSING or rid == "":
            raw_prompt = meta.get("messages", prompt)
            rid = stable_id(raw_prompt, answer)
        records.append(PromptRecord(id=str(rid), prompt=prompt, answer=answer, meta=meta))
    if not records:
        raise DatasetError(f"data file {path} has no rows")
    return _dedup_ids(records)


# --------------------------------------------------------------------------- synthetic

def _synthetic(n: int, seed: int, terms: tuple[int, int]) -> list[PromptRecord]:
    return [PromptRecord(id=r["id"], prompt=r["prompt"], answer=r["answer"],
                         meta={"format": "synthetic", "source": "synthetic", "solution": r["solution"]})
            for r in synthetic.make_records(n, seed, min_terms=terms[0], max_terms=terms[1])]


def _synthetic_eval(data_cfg: DataConfig, seed: int) -> list[PromptRecord]:
    """Eval problems from another seed, minus any prompt that also occurs in the train set."""
    train_prompts = {r.prompt for r in _synthetic(data_cfg.num_synthetic, seed, data_cfg.synthetic_terms)}
    n, out = data_cfg.num_eval, []
    pool = max(2 * n, 16)
    while len(out) < n:
        out = [r for r in _synthetic(pool, seed + EVAL_SEED_OFFSET, data_cfg.synthetic_terms) if r.prompt not in train_prompts][:n]
        if len(out) < n and pool > 64 * max(n, 1):   # only a draw that came up short is the last
            raise DatasetError(f"cannot draw {n} synthetic eval problems disjoint from the "
                               f"{data_cfg.num_synthetic} train problems; lower data.num_eval")
        pool *= 2
    return out


def load_records(data_cfg: DataConfig, split: str = "train", seed: int = 0) -> list[PromptRecord]:
    """Records of `split`: 'train' reads data.source, 'eval' reads data.eval_source.

    Synthetic data uses data.num_synthetic (train) and data.num_eval (eval,
    another seed, disjoint prompts). For a file source without an eval_source
    there is no eval set. Eval sets are capped at the first num_eval records;
    num_eval=0 disables evaluation.
    """
    if split not in ("train", "eval"):
        raise ValueError(f"split must be 'train' or 'eval', got {split!r}")
    if split == "train":
        if data_cfg.source == "synthetic":
            return _synthetic(data_cfg.num_synthetic, seed, data_cfg.synthetic_terms)
        return load_file(data_cfg.source, data_cfg)
    if data_cfg.num_eval == 0:
        return []
    source = data_cfg.eval_source
    if source is None:
        source = "synthetic" if data_cfg.source == "synthetic" else None
    if source is None:
        return []
    if source == "synthetic":
        return _synthetic_eval(data_cfg, seed)
    return load_file(source, data_cfg)[: data_cfg.num_eval]


# --------------------------------------------------------------------------- loader

class PromptLoader:
    """Endless batches of records in a per-epoch shuffled order that a checkpoint can restore.

    The order of epoch e depends only on (seed, e), so restoring (epoch, position)
    replays exactly the batches an uninterrupted run would have seen.
    """

    def __init__(self, records: list[PromptRecord], batch_size: int, seed: int, shuffle: bool = True):
        if not records:
            raise ValueError("PromptLoader needs at least one record")
        if batch_size < 1 or batch_size > len(records):
            raise ValueError(f"batch_size={batch_size} must be between 1 and the number of records ({len(records)})")
        self.records = list(records)
        self.batch_size = batch_size
        self.seed = seed
        self.shuffle = shuffle
        self._epoch = 0
        self._position = 0
        self._order = self._order_for(0)

    def _order_for(self, epoch: int) -> list[int]:
        order = list(range(len(self.records)))
        if self.shuffle:
            random.Random(f"{self.seed}:{epoch}").shuffle(order)  # str seeds hash deterministically
        return order

    @property
    def epoch(self) -> int:
        return self._epoch

    @property
    def position(self) -> int:
        return self._position

    def next_batch(self) -> list[PromptRecord]:
        """The next batch_size records of this epoch's order. Where fewer than batch_size are left, the
        epoch ends there (verl's drop_last; each epoch's shuffle leaves out other records): a batch
        running on into the next epoch could hold a record twice, and two groups of one prompt in a
        step would share their seeds, their last-epoch drafts and their GRPO group."""
        if self._position + self.batch_size > len(self._order):
            self._epoch += 1
            self._position = 0
            self._order = self._order_for(self._epoch)
        batch = [self.records[i] for i in self._order[self._position:self._position + self.batch_size]]
        self._position += self.batch_size
        return batch

    def peek_batch(self) -> list[PromptRecord]:
        """The batch `next_batch` will return next, without taking it (run-ahead drafting)."""
        state = (self._epoch, self._position, self._order)
        try:
            return self.next_batch()
        finally:
            self._epoch, self._position, self._order = state

    def state_dict(self) -> dict:
        return {"epoch": self._epoch, "position": self._position, "seed": self.seed,
                "shuffle": self.shuffle, "num_records": len(self.records), "batch_size": self.batch_size}

    def load_state_dict(self, state: dict) -> None:
        """Restore (epoch, position); refuses a state saved over different data or another seed.

        Another batch size (trainer.gen_prompts_per_step changed on resume) is accepted, as verl's
        StatefulDataLoader accepts it, with a warning: the epoch's order and the position in it are
        the same, only the batches from here on are cut at other boundaries (an epoch then ends
        where fewer than the new batch size are left). Nothing downstream depends on the old size:
        DAPO rounds and run-ahead peeks draw batches of the current one, and data_order.jsonl is
        only written and trimmed, never checked against the loader. A state saved before the batch
        size was kept (no key) loads as before."""
        for key, mine in (("num_records", len(self.records)), ("seed", self.seed), ("shuffle", self.shuffle)):
            if key in state and state[key] != mine:
                raise ValueError(f"loader state was saved with {key}={state[key]!r} but this loader has "
                                 f"{key}={mine!r}; the data order cannot be restored")
        if not 0 <= state["position"] <= len(self.records):
            raise ValueError(f"loader state position {state['position']} out of range")
        if state.get("batch_size", self.batch_size) != self.batch_size:
            log.warning("loader state was saved with batch_size=%s but this loader has batch_size=%d "
                        "(trainer.gen_prompts_per_step): the data order continues at epoch %s position %s, "
                        "in batches cut at other boundaries than the checkpointed run's",
                        state["batch_size"], self.batch_size, state["epoch"], state["position"])
        self._epoch = int(state["epoch"])
        self._position = int(state["position"])
        self._order = self._order_for(self._epoch)


# --------------------------------------------------------------------------- rendering

def uses_chat_template(tokenizer, apply_chat_template: bool | None) -> bool:
    """data.apply_chat_template: None (auto) renders through the tokenizer's chat template when it has
    one, as verl does for every prompt; true requires one (a tokenizer without it would otherwise train
    an instruct model on raw text, silently); false encodes the raw text (the last user turn)."""
    has_template = bool(getattr(tokenizer, "chat_template", None))
    if apply_chat_template and not has_template:
        raise DatasetError("data.apply_chat_template=true, but the tokenizer of model.path has no chat template "
                           "(tokenizer_config.json chat_template); set it to false or leave it unset (auto)")
    return has_template if apply_chat_template is None else apply_chat_template


def render_prompt(record: PromptRecord, tokenizer, apply_chat_template: bool | None) -> list[int]:
    """Token ids of the prompt the policy continues.

    Through the chat template (uses_chat_template), the chat messages (or the prompt as one user turn)
    are rendered with the generation prompt; the template supplies any BOS. Otherwise the raw text is
    encoded with the tokenizer's own special tokens (none for the tiny tokenizer).
    """
    if uses_chat_template(tokenizer, apply_chat_template):
        messages = record.meta.get("messages") or [{"role": "user", "content": record.prompt}]
        try:
            text = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
        except Exception as e:   # jinja's TemplateError ("roles must alternate ..."), raised by the template itself
            raise DatasetError(f"record {record.id!r} ({record.meta.get('source', '?')}): the tokenizer's chat "
                               f"template refused its messages: {' '.join(str(e).split())}; fix the row or set "
                               "data.apply_chat_template=false") from None
        ids = tokenizer(text, add_special_tokens=False).input_ids
    else:
        ids = tokenizer(record.prompt, add_special_tokens=True).input_ids
    return list(ids)   # its length is checked for the whole data set at once (render_all)


def render_all(records: list[PromptRecord], tokenizer, apply_chat_template: bool | None, max_prompt_len: int,
               drop_overlong: bool, split: str) -> tuple[list[PromptRecord], dict[str, list[int]]]:
    """Every prompt rendered once when the run starts: (records kept, token ids by record id).

    A prompt longer than max_prompt_len would otherwise stop the run at the step that draws it,
    hours in. Refused here with the count and the longest one, or, with data.filter_overlong_prompts
    (verl's key and rule), left out of the run. The ids are kept: each step reads them instead of
    rendering its prompts again."""
    kept, ids_by_id, overlong = [], {}, []
    for rec in records:
        ids = render_prompt(rec, tokenizer, apply_chat_template)
        if not ids:   # the engines refuse an empty prompt, at the step that draws it
            raise DatasetError(f"{split} record {rec.id!r} ({rec.meta.get('source', '?')}) renders to no tokens")
        if len(ids) > max_prompt_len:
            overlong.append((len(ids), rec.id))
            continue
        kept.append(rec)
        ids_by_id[rec.id] = ids
    if overlong and not drop_overlong:
        n, rid = max(overlong)
        raise PromptTooLongError(f"{len(overlong)} of {len(records)} {split} prompts are longer than "
                                 f"data.max_prompt_len={max_prompt_len} (the longest: record {rid!r}, {n} tokens); "
                                 "raise it, or set data.filter_overlong_prompts=true to leave them out")
    if overlong:
        log.warning("data.filter_overlong_prompts: left out %d of %d %s prompts longer than "
                    "data.max_prompt_len=%d", len(overlong), len(records), split, max_prompt_len)
    return kept, ids_by_id


__all__ = ["PromptRecord", "DatasetError", "PromptTooLongError", "load_records", "load_file", "render_all",
           "detect_format", "file_format", "stable_id", "last_boxed", "gsm8k_final_answer", "PromptLoader", "render_prompt"]

"""An HF checkpoint directory's safetensors, read one tensor at a time.

Every learner rank builds its model slice from the HF checkpoint. Reading whole files into memory
(safetensors' load_file) gives each rank the whole model first: 140 GB a rank for Llama-3.1-70B in
bf16, 1.1 TB on an 8-GPU node, for slices of a few GB. `HFCheckpoint` is a read-only mapping from
tensor names to tensors that opens the files' headers once (names, dtypes, shapes) and reads a tensor
only when it is asked for, through safetensors' memory-mapped `safe_open`; a rank asks only for its
pipeline stage's tensors (hf_mapping.hf_to_megatron_shards with `only`), keeps its TP slice and drops
the rest. Shapes come from the headers, so checking a checkpoint (hf_mapping.validate_hf_state) reads
no tensor data.

`save_hf_shards` writes the other way, as transformers' save_pretrained lays a checkpoint out, one
shard in memory at a time.

Which files: those `model.safetensors.index.json` names when it exists (what transformers loads; a
stray `consolidated.safetensors` beside the shards is not read), else every `*.safetensors`. A tensor
in two files is an error rather than whichever file came last.
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Iterator, Mapping
from pathlib import Path

import torch
from torch import Tensor

from megatron_specrl.learner.hf_mapping import CheckpointError

INDEX_FILE = "model.safetensors.index.json"


class HFCheckpoint(Mapping):
    """Tensor name -> tensor, read on access from the directory's safetensors files."""

    def __init__(self, hf_dir: str | Path):
        from safetensors import safe_open

        self.dir = Path(hf_dir)
        self._file_of: dict[str, Path] = {}
        self._shape_of: dict[str, tuple[int, ...]] = {}
        for f in self._files():
            try:
                with safe_open(str(f), framework="pt") as st:
                    for name in st.keys():
                        if name in self._file_of:
                            raise CheckpointError(f"tensor {name!r} is in both {self._file_of[name].name} and "
                                                  f"{f.name} in {self.dir}")
                        self._file_of[name] = f
                        self._shape_of[name] = tuple(st.get_slice(name).get_shape())
            except CheckpointError:
                raise
            except Exception as e:  # truncated / corrupt header
                raise CheckpointError(f"cannot read {f}: {e}") from None

    def _files(self) -> list[Path]:
        index = self.dir / INDEX_FILE
        if index.is_file():
            try:
                weight_map = json.loads(index.read_text())["weight_map"]
            except (ValueError, KeyError) as e:
                raise CheckpointError(f"cannot read {index}: {e!r}") from None
            files = sorted({self.dir / f for f in weight_map.values()})
            missing = [f.name for f in files if not f.is_file()]
            if missing:
                raise CheckpointError(f"{index} names files that are not there: {missing}")
            return files
        files = sorted(self.dir.glob("*.safetensors"))
        if not files:
            raise CheckpointError(f"no *.safetensors files in {self.dir}")
        return files

    def shape(self, name: str) -> tuple[int, ...]:
        """From the file's header: no tensor data is read."""
        return self._shape_of[name]

    def __getitem__(self, name: str) -> Tensor:
        from safetensors import safe_open

        f = self._file_of[name]      # KeyError for a name the checkpoint does not hold, as a dict
        try:
            with safe_open(str(f), framework="pt") as st:
                return st.get_tensor(name)
        except Exception as e:  # data shorter than the header says
            raise CheckpointError(f"cannot read tensor {name!r} from {f}: {e}") from None

    def __contains__(self, name: object) -> bool:
        return name in self._file_of

    def __iter__(self) -> Iterator[str]:
        return iter(self._file_of)

    def __len__(self) -> int:
        return len(self._file_of)


# transformers' save_pretrained default (max_shard_size="5GB"); small enough for any loader's memory
MAX_SHARD_BYTES = 5 * 10**9


def save_hf_shards(tensors: Iterable[tuple[str, Tensor]], out_dir: str | Path, dtype: torch.dtype | None = None,
                   max_shard_bytes: int = MAX_SHARD_BYTES) -> list[Path]:
    """Write (name, tensor) pairs as transformers writes a checkpoint: `model.safetensors` when they fit
    one shard, else `model-0000k-of-0000n.safetensors` files of at most `max_shard_bytes` each and
    `model.safetensors.index.json`. Streaming: one shard in memory at a time, not the model (the
    learner's fp32 Llama-3.1-70B is 280 GB). Floating tensors are cast to `dtype` (the checkpoint's
    own, from its config.json). Earlier safetensors files in `out_dir` are removed first, so a re-export
    never mixes with an older one."""
    from safetensors.torch import save_file

    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    for old in [*out.glob("*.safetensors"), out / INDEX_FILE]:
        old.unlink(missing_ok=True)
    written: list[tuple[Path, list[str]]] = []
    shard: dict[str, Tensor] = {}
    size = total = 0

    def flush() -> None:
        path = out / f".shard-{len(written):05d}.safetensors"
        save_file(shard, str(path), metadata={"format": "pt"})
        written.append((path, list(shard)))
        shard.clear()

    for name, t in tensors:
        if dtype is not None and t.is_floating_point():
            t = t.to(dtype)
        t = t.contiguous()
        n = t.numel() * t.element_size()
        if shard and size + n > max_shard_bytes:
            flush()
            size = 0
        shard[name] = t
        size += n
        total += n
    if shard or not written:
        flush()
    if len(written) == 1:
        final = [out / "model.safetensors"]
    else:
        final = [out / f"model-{i + 1:05d}-of-{len(written):05d}.safetensors" for i in range(len(written))]
    for (tmp, _), path in zip(written, final):
        tmp.rename(path)
    if len(final) > 1:
        (out / INDEX_FILE).write_text(json.dumps(
            {"metadata": {"total_size": total},
             "weight_map": {name: path.name for (_, names), path in zip(written, final) for name in names}}, indent=2))
    return final

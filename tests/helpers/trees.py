"""Reading the responses a drafter's trees hold."""

from __future__ import annotations

from collections import Counter


def sequences(trees) -> dict[str, Counter]:
    """key -> multiset of its stored sequences (DraftTrees.state_dict)."""
    state = trees.state_dict()
    flat, out, i, pos = state["tokens"].tolist(), {}, 0, 0
    lengths = state["seq_lengths"].tolist()
    for key, n in zip(state["keys"], state["key_num_seqs"].tolist()):
        c = out.setdefault(key, Counter())
        for _ in range(n):
            c[tuple(flat[pos:pos + lengths[i]])] += 1
            pos += lengths[i]
            i += 1
    return out



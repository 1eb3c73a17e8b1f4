"""Per-prompt draft trees: the speculative core of suffix-style drafting (SuffixDecoding / SRT).

For every key (a prompt id; all samples of a prompt share one tree) this keeps a suffix structure
over the token ids of every response to that prompt: finished samples, earlier epochs, and the
sequences still being generated, inserted token by token "in flight" so that sibling requests can
draft from each other immediately. ``propose`` turns it into a draft continuation for one request.
It imports only the standard library and numpy, so it can run inside vLLM's proposer.

Semantics (those of a depth-bounded suffix trie with occurrence counts)
-----------------------------------------------------------------------
Conceptually the key's tree is the trie of every substring of length <= ``max_depth`` of every
inserted sequence, each node counting the occurrences of its substring (each occurrence in any
sequence adds 1, so within a sequence repeats count too). ``propose(request_id, max_tokens,
min_prob)``:

1. The context is the request's own sequence so far (start + extend tokens). Find the longest
   suffix m of the context, 1 <= |m| <= ``max_match``, that has at least one occurrence followed by
   a token (a continuation). The request's own occurrence at its end has no continuation yet, nor
   do the ends of other in-flight sequences, so those alone never make a match. None: return [].
2. From m walk down, always taking the most frequent child (ties: smallest token id), appending its
   token while (a) fewer than ``max_tokens`` tokens are proposed, (b) the node stays within depth
   ``max_depth`` (|m| + len(draft) <= max_depth), (c) the path probability, the product of
   kappa x child.count / sum(children counts) along the walk, stays >= ``min_prob``. ``kappa`` (1 by
   default) is the caller's calibration of the tree's frequencies against what the engine accepts
   (rollout/tree_drafting/drafter.py): a path seen once has frequency 1 at every node, which the engine's
   samples follow far less often when the tree holds only a few in-flight siblings.

Design: one generalized suffix automaton per key (not a literal trie)
--------------------------------------------------------------------
A trie of all suffixes costs O(max_depth) node updates per token (32 dict updates, ~4 us a token
in CPython, and up to 32 new nodes per novel token), which misses the budget (about 10 us per
request per engine step, extension and proposal together). So each key holds a generalized suffix
automaton (DAWG) over its sequences, built online (amortized O(1) new states and transitions per
token), which gives exactly the trie's answers:

* every substring s of the key's sequences lies in exactly one state, and all strings of a state
  have the same end positions, so ``cnt[state]`` = occurrences of s = the trie node's count. It is
  kept exact for every state whose shortest string is <= ``max_depth`` long (the only ones the trie
  has): each appended token adds 1 along the suffix links from the sequence's *anchor*, the state
  of its suffix of length min(len, max_depth). That is at most max_depth increments a token
  (typically ~7), even in a long repetition loop, where the chain from the whole string would
  grow with the loop. A split state's clone inherits its shortest strings and its count, so
  exactness survives splits.
* the trie children of s are the automaton's transitions c -> state(s + c), and a state has
  transitions iff some occurrence of its strings is followed by a token. So the match needs no
  re-matching: from the anchor, suffix links lead to the state of the context's suffix of length
  min(len, max_match), then on to the first state with transitions (its strings are suffixes
  with a continuation; shorter suffixes higher up have a superset of transitions). The request's
  own end has no transition yet, so it never counts.
* the walk reads transitions and counts. States with exactly one transition (most of them) also
  keep it in two side lists (``utok``/``ustate``), so such a step is two list reads.

Sequences of one key may grow interleaved (each request keeps its own ``last`` and anchor
states); the construction handles an existing transition from ``last`` (the generalized-automaton
case, splitting where needed), and counts are per (sequence, position), so identical samples count
twice, as in the trie. tests/unit/rollout/test_draft_tree.py checks proposals and counts against a brute-force
implementation of the trie semantics on random interleaved and repetitive sequences.

Size unit and eviction
----------------------
``max_nodes`` bounds the automaton states of all keys together (they stand in for the trie's
nodes; a key's root is not counted). A token adds 0, 1 or 2 states (2 when a state is split), so
states <= 2 x stored tokens; mutated copies of a trace measured ~1.5 a token. ``stats()['nodes']``
reports that count. When an append finds fewer than 2 free states, whole keys are evicted, least
recently used first (a key is used when a request for it starts or proposes; a new key starts as
the most recent; inserting into an existing key does not count), never a key with active requests
and never the key being inserted into. If that still does not make room, insertion into the key
stops: ``insert`` keeps the prefix that fitted; an in-flight request keeps drafting (its further
tokens no longer enter the tree but still form its context, matched afresh against the stored
tree on each propose) and nothing raises. A key that collects the responses of all prompts (the
engines' shared tree) is kept bounded by ``keep_newest``, which rebuilds it from its newest
sequences. ``stats()['memory_bytes']`` is ``sys.getsizeof`` over
the containers plus the per-state dicts and non-cached ints of ~4096 states sampled over all keys,
scaled to each key's size; it agrees with tracemalloc within 1% (a test checks 15%). Measured:
300-320 bytes a state, ~450 bytes a token of mutated arithmetic traces.

Persistence
-----------
``state_dict`` stores the raw sequences per key (in-flight sequences' stored tokens so far, as
finished sequences) in LRU order as numpy arrays plus json-able values; ``from_state_dict``
rebuilds the automata (measured ~0.15 s per 100k tokens), under the bounds of the side that loads
them where it passes its own (a resumed run with other settings). Proposals depend only on the
multiset of stored sequences of a key, so a request started with the same tokens after a restore
drafts exactly as it would have before (under the same bounds). Requests themselves are not saved
(a resumed run starts them anew).

Token ids are ints (numpy integers are converted in ``start``/``insert``; ``extend``, the hot path,
expects Python ints, as vLLM hands out). Timings: benchmarks/bench_draft_tree.py.

Two implementations
-------------------
This module is the reference: plain Python lists and dicts, readable next to the semantics above.
rollout/tree_drafting/compiled_trees.py subclasses it and keeps the same automata in numpy arrays built and
read by numba, replacing only ``_new_tree``/``_drop_tree``/``_feed_tree`` (storage and construction)
and the reads; all bookkeeping (LRU, eviction, frozen requests, ``keep_newest``, persistence) is
this class's. The engines call ``extend_and_propose`` once per request and step, which the compiled
class does in one compiled call: the same drafts (tests compare both) for about half the drafter's
time inside vLLM and a third of it replayed alone (docs/benchmarks/2026-11-23-avx512.md).
"""

from __future__ import annotations

import json
import sys
from collections import OrderedDict
from pathlib import Path
from collections.abc import Hashable, Sequence

import numpy as np

_FORMAT = "draft_trees/1"
_ARRAYS = ("key_num_seqs", "seq_lengths", "tokens")   # a state_dict's numpy arrays (the rest is json)
_NO_FIRST = (-1, 0.0)                    # a walk without a first token
_NPZ = "draft_trees.npz"
_JSON = "draft_trees.json"
_MEM_SAMPLE = 4096   # states sampled (over all keys) by stats() for memory_bytes
_UNBOUNDED = 1 << 62


class _Tree:
    """The suffix automaton of one key: parallel lists indexed by state id; state 0 is the root."""

    __slots__ = ("trans", "link", "length", "cnt", "utok", "ustate", "seqs", "active", "seq_bytes")
    root = 0

    def __init__(self):
        self.trans: list[dict[int, int]] = [{}]   # token -> state
        self.link: list[int] = [-1]                # suffix link
        self.length: list[int] = [0]               # length of the longest string of the state
        self.cnt: list[int] = [0]                  # occurrences (end positions over all sequences)
        self.utok: list[int] = [-1]                # the only transition's token, -1 if not exactly one
        self.ustate: list[int] = [0]               # ... and its target
        self.seqs: list[list[int]] = []            # stored tokens of every sequence
        self.active = 0                            # requests of this key still generating
        self.seq_bytes = 0                         # sequences_bytes of its finished sequences

    @property
    def nodes(self) -> int:
        return len(self.length) - 1


class _Request:
    __slots__ = ("tree", "key", "seq", "last", "anchor", "tail")

    def __init__(self, tree: _Tree, key: str, seq: list[int]):
        self.tree = tree
        self.key = key
        self.seq = seq              # the stored sequence (also in tree.seqs)
        self.last = tree.root       # automaton state of the whole stored sequence
        self.anchor = tree.root     # state of its suffix of length min(len, max_depth)
        self.tail = None      # tokens past the stored ones, once the tree had no room (else None)


def _split(tree: _Tree, q: int, new_length: int, p: int, c: int) -> int:
    """Suffix-automaton split: clone state q with the shorter strings (length <= new_length), point
    the c-transitions into q along p's suffix-link chain at the clone, and make it q's link. The clone
    starts with q's transitions and count (it holds q's shortest string). Returns the clone."""
    trans, link, length, cnt, utok, ustate = tree.trans, tree.link, tree.length, tree.cnt, tree.utok, tree.ustate
    clone = len(length)
    trans.append(trans[q].copy())
    link.append(link[q])
    length.append(new_length)
    cnt.append(cnt[q])
    utok.append(utok[q])
    ustate.append(ustate[q])
    while p != -1 and trans[p].get(c) == q:
        trans[p][c] = clone
        if utok[p] >= 0:
            ustate[p] = clone
        p = link[p]
    link[q] = clone
    return clone


def _feed(tree: _Tree, last: int, anchor: int, n: int, tokens, room: int, depth: int) -> tuple[int, int, int]:
    """Append `tokens` to a sequence of length `n` whose whole string is in state `last` and whose
    suffix of length min(n, depth) is in state `anchor`; stop before a token when fewer than 2 of
    `room` new states are left. Returns (last, anchor, tokens appended).

    Counts are kept exact for every state whose shortest string is at most `depth` long (the only
    ones a depth-bounded trie has): a new position adds 1 from the anchor down the suffix links,
    so a token costs at most `depth` increments even in long repetition loops. A split copies the
    count of the state it splits, whose shortest string it inherits, so that stays exact."""
    trans, link, length, cnt, utok, ustate = tree.trans, tree.link, tree.length, tree.cnt, tree.utok, tree.ustate
    limit = len(length) + room - 2
    dm1 = depth - 1
    done = 0
    for c in tokens:
        if len(length) > limit:
            break
        q = trans[last].get(c)
        if q is not None:                       # the string + c already occurs (generalized case)
            lc = length[last] + 1
            if length[q] == lc:
                cur = q
            else:                               # split q: strings of length <= lc move to a clone
                cur = _split(tree, q, lc, last, c)
        else:
            cur = len(length)
            trans.append({})
            link.append(0)
            length.append(length[last] + 1)
            cnt.append(0)
            utok.append(-1)
            ustate.append(0)
            p = last
            while p != -1 and c not in (d := trans[p]):
                d[c] = cur
                if len(d) == 1:
                    utok[p] = c
                    ustate[p] = cur
                else:
                    utok[p] = -1
                p = link[p]
            if p != -1:
                q = trans[p][c]
                lp = length[p] + 1
                if length[q] == lp:
                    link[cur] = q
                else:
                    link[cur] = _split(tree, q, lp, p, c)
        n += 1
        if n <= depth:
            v = anchor = cur
        else:                                   # old suffix of length depth - 1, then + c
            while length[link[anchor]] >= dm1:
                anchor = link[anchor]
            v = anchor = trans[anchor][c]
        while v:                                # one more occurrence of each short suffix
            cnt[v] += 1
            v = link[v]
        last = cur
        done += 1
    return last, anchor, done


def sequences_bytes(seqs: list[list[int]]) -> int:
    """sys.getsizeof of stored token lists, their non-cached ints sampled (every len/16-th token)."""
    total = 0
    for seq in seqs:
        total += sys.getsizeof(seq)
        if seq:
            picked = seq[::max(1, len(seq) // 16)]
            total += sum(sys.getsizeof(x) for x in picked if not -5 <= x <= 256) * len(seq) // len(picked)
    return total


def _check_int(name: str, value, minimum: int) -> int:
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or value < minimum:
        raise ValueError(f"{name} must be an int >= {minimum}, got {value!r}")
    return int(value)


class DraftTrees:
    """Draft trees for all keys; see the module docstring for semantics, design and limits."""

    def __init__(self, max_depth: int = 32, max_match: int = 16, max_nodes: int = 2_000_000):
        self.max_match = _check_int("max_match", max_match, 1)
        self.max_depth = _check_int("max_depth", max_depth, 2)
        if self.max_depth <= self.max_match:
            raise ValueError(f"max_depth ({max_depth}) must be > max_match ({max_match}) so a match can be "
                             "continued; use max_depth >= max_match + the largest max_tokens")
        self.max_nodes = _check_int("max_nodes", max_nodes, 2)
        self._trees: OrderedDict[str, _Tree] = OrderedDict()   # LRU order: oldest first
        self._reqs: dict[Hashable, _Request] = {}
        self._nodes = 0
        self._evicted = 0

    # -- sizing ------------------------------------------------------------
    def _make_room(self, need: int, keep: _Tree) -> bool:
        """Evict least recently used inactive keys (never `keep`) until `need` more states fit."""
        if self._nodes + need <= self.max_nodes:
            return True
        victims = []
        freed = 0
        for key, tree in self._trees.items():
            if self._nodes - freed + need <= self.max_nodes:
                break
            if tree is keep or tree.active:
                continue
            victims.append(key)
            freed += tree.nodes
        for key in victims:
            self._drop_tree(self._trees.pop(key))
        self._nodes -= freed
        self._evicted += len(victims)
        return self._nodes + need <= self.max_nodes

    # -- the automaton's storage (CompiledDraftTrees keeps the same automata in numpy arrays) -------
    def _new_tree(self) -> _Tree:
        return _Tree()

    def _drop_tree(self, tree: _Tree) -> None:
        """A tree left the trees (evicted, or replaced by keep_newest): nothing to free here."""

    def _feed_tree(self, tree: _Tree, last: int, anchor: int, n: int, tokens, room: int) -> tuple[int, int, int, int]:
        """`_feed`, and the states it made: (last, anchor, tokens appended, new states)."""
        n0 = len(tree.length)
        last, anchor, done = _feed(tree, last, anchor, n, tokens, room, self.max_depth)
        return last, anchor, done, len(tree.length) - n0

    def _tree(self, key: str, use: bool) -> _Tree:
        """The key's tree, created as the most recently used key if new; `use` marks an existing
        key as used (requests starting; inserting whole sequences does not count as use)."""
        tree = self._trees.get(key)
        if tree is None:
            if not isinstance(key, str):
                raise TypeError(f"draft tree keys are prompt id strings, got {type(key).__name__}")
            tree = self._trees[key] = self._new_tree()
        elif use:
            self._trees.move_to_end(key)
        return tree

    def _append(self, tree: _Tree, seq: list[int], last: int, anchor: int,
                tokens: list[int]) -> tuple[int, int, int]:
        """Append to a stored sequence within the size bound, evicting keys only as the room runs
        out (a token needs at most 2 states); returns (last, anchor, tokens stored)."""
        done, n = 0, len(tokens)
        while done < n:
            room = self.max_nodes - self._nodes
            if room < 2:
                if not self._make_room(2, tree):
                    break
                room = self.max_nodes - self._nodes
            chunk = tokens[done:done + room // 2]    # surely fits: the feed cannot stop inside it
            last, anchor, k, made = self._feed_tree(tree, last, anchor, len(seq), chunk, room)
            self._nodes += made
            seq.extend(chunk if k == len(chunk) else chunk[:k])
            done += k
        return last, anchor, done

    # -- in-flight sequences -------------------------------------------------
    def start(self, request_id: Hashable, key: str, tokens: Sequence[int] = ()) -> None:
        """Begin a sequence for `key`; `tokens` are already part of it (inserted as by extend)."""
        if request_id in self._reqs:
            raise ValueError(f"request {request_id!r} already started")
        tree = self._tree(key, use=True)
        seq: list[int] = []
        tree.seqs.append(seq)
        tree.active += 1
        self._reqs[request_id] = _Request(tree, key, seq)
        if len(tokens):
            self.extend(request_id, [int(t) for t in tokens])

    def extend(self, request_id: Hashable, tokens: Sequence[int]) -> None:
        """Append newly generated tokens; they enter the key's tree at once (siblings draft from them)."""
        req = self._reqs[request_id]
        if req.tail is not None:
            req.tail.extend(tokens)
            return
        tree = req.tree
        n = len(tokens)
        if self._nodes + 2 * n <= self.max_nodes:          # fast path: room for any outcome
            req.last, req.anchor, _, made = self._feed_tree(tree, req.last, req.anchor, len(req.seq), tokens,
                                                            _UNBOUNDED)
            self._nodes += made
            req.seq.extend(tokens)
            return
        tokens = list(tokens)
        req.last, req.anchor, done = self._append(tree, req.seq, req.last, req.anchor, tokens)
        if done < len(tokens):
            req.tail = tokens[done:]          # no room: keep drafting from the stored part

    def finish(self, request_id: Hashable) -> None:
        """The sequence is complete: forget the request (its stored tokens stay in the tree)."""
        req = self._reqs.pop(request_id)
        req.tree.active -= 1
        req.tree.seq_bytes += sequences_bytes([req.seq])

    def propose(self, request_id: Hashable, max_tokens: int, min_prob: float = 0.1) -> list[int]:
        """Draft up to `max_tokens` tokens continuing the request's sequence (see module docstring)."""
        return self.propose_scored(request_id, max_tokens, min_prob)[0]

    def extend_and_propose(self, request_ids: Sequence[Hashable], tokens: Sequence[int], max_tokens: int,
                           min_prob: float = 0.1, kappas: Sequence[float] | None = None
                           ) -> tuple[list[int], int, tuple[tuple[int, float], ...]]:
        """Extend each request (several sequences growing alike, e.g. one in its prompt's tree and one
        in a shared tree) by `tokens`, then draft from the best of their proposals: a later request's
        draft replaces the draft so far when it differs and scores at least as high. `kappas`: each
        request's calibration (`propose_scored`; default 1). Returns (draft, index of the request it
        came from, each request's first proposed token and its tree frequency, whatever the cut-off:
        (-1, 0.0) where its tree has no continuation), the last so that the caller can check its
        calibration against the token the engine samples next. One call per engine step and request,
        so that CompiledDraftTrees can do it all in one compiled call."""
        if len(tokens):
            for rid in request_ids:
                self.extend(rid, tokens)
        best: list[int] = []
        best_score, src = 0.0, 0
        firsts = []
        for i, rid in enumerate(request_ids):
            draft, score, first = self._propose_from(rid, max_tokens, min_prob, 1.0 if kappas is None else kappas[i])
            firsts.append(first)
            if i == 0 or (score >= best_score and draft != best):
                best, best_score, src = draft, score, i
        return best, src, tuple(firsts)

    def propose_scored(self, request_id: Hashable, max_tokens: int, min_prob: float = 0.1,
                       kappa: float = 1.0) -> tuple[list[int], float]:
        """`propose`'s draft and its expected number of accepted tokens if the tree's frequencies,
        each scaled by `kappa`, were the model's: the sum over the draft of the path probability up to
        each token (a draft is accepted token by token until the first miss). Two sources' drafts
        compare by it."""
        return self._propose_from(request_id, max_tokens, min_prob, kappa)[:2]

    def _propose_from(self, request_id: Hashable, max_tokens: int, min_prob: float,
                      kappa: float) -> tuple[list[int], float, tuple[int, float]]:
        """propose_scored's draft and score, and the walk's first token with its frequency (the
        probability factor of the first step, before kappa and the cut-off), (-1, 0.0) if none."""
        req = self._reqs[request_id]
        self._trees.move_to_end(req.key)
        tree = req.tree
        trans, link, length = tree.trans, tree.link, tree.length
        max_match = self.max_match
        if req.tail is None:
            v = req.anchor                       # suffix of length min(len, max_depth) ...
            if not v:
                return [], 0.0, _NO_FIRST
            while length[link[v]] >= max_match:  # ... -> of length min(len, max_match)
                v = link[v]
            while v and not trans[v]:            # shorter until one has a continuation
                v = link[v]
            if not v:
                return [], 0.0, _NO_FIRST
            m = length[v]
            if m > max_match:
                m = max_match
        else:
            v, m = self._match(tree, req)
            if not v:
                return [], 0.0, _NO_FIRST
        room = self.max_depth - m                # deepest node: depth max_depth
        if max_tokens > room:
            max_tokens = room
        out: list[int] = []
        if max_tokens <= 0 or min_prob > 1.0:
            return out, 0.0, _NO_FIRST
        append = out.append
        cnt, utok, ustate = tree.cnt, tree.utok, tree.ustate
        prob, score = 1.0, 0.0
        first = _NO_FIRST
        for i in range(max_tokens):
            c = utok[v]
            if c >= 0:                           # one child: frequency 1
                if i == 0:
                    first = (c, 1.0)
                if kappa != 1.0:
                    prob *= kappa
                    if prob < min_prob:
                        break
                append(c)
                score += prob
                v = ustate[v]
                continue
            d = trans[v]
            if not d:
                break
            best = -1
            bc = tot = 0
            for c, u in d.items():
                k = cnt[u]
                tot += k
                if k > bc or (k == bc and c < best):
                    bc, best, bu = k, c, u
            if i == 0:
                first = (best, bc / tot)
            prob *= kappa * bc / tot if kappa != 1.0 else bc / tot
            if prob < min_prob:
                break
            append(best)
            score += prob
            v = bu
        return out, score, first

    def _context(self, req: _Request) -> list[int]:
        """The last max_match tokens of a frozen request (its stored tokens, then its tail)."""
        M, tail = self.max_match, req.tail
        return tail[-M:] if len(tail) >= M else req.seq[max(0, len(req.seq) - (M - len(tail))):] + tail

    def _match(self, tree: _Tree, req: _Request) -> tuple[int, int]:
        """(state, length) of the longest suffix with a continuation, matched from scratch over the
        last max_match tokens of the context (for requests whose tokens no longer enter the tree)."""
        trans, link, length = tree.trans, tree.link, tree.length
        ctx = self._context(req)
        v = n = 0
        for c in ctx:
            while v and c not in trans[v]:
                v = link[v]
                n = length[v]
            u = trans[v].get(c)
            if u is not None:
                v = u
                n += 1
        while v and not trans[v]:
            v = link[v]
            n = length[v]
        return v, n

    # -- whole sequences -----------------------------------------------------
    def insert(self, key: str, tokens: Sequence[int]) -> None:
        """Insert a whole sequence for `key` (e.g. a finished response, or when rebuilding)."""
        tree = self._tree(key, use=False)
        seq: list[int] = []
        tree.seqs.append(seq)
        toks = [int(t) for t in tokens]
        if toks:
            self._append(tree, seq, tree.root, tree.root, toks)
        tree.seq_bytes += sequences_bytes([seq])

    def keep_newest(self, key: str, max_nodes: int) -> int:
        """Rebuild `key`'s automaton from its in-flight sequences and its newest finished ones that fit
        in `max_nodes` states (counting 2 a token, the most a token can add); returns how many finished
        sequences were dropped. A key shared by all prompts grows with every response, and an
        automaton cannot forget a sequence: rebuilding from the newest is how it stays bounded. Its
        requests keep drafting (re-pointed to the new automaton's states)."""
        old = self._trees.get(key)
        if old is None:
            return 0
        live = [r for r in self._reqs.values() if r.tree is old]
        live_ids = {id(r.seq) for r in live}
        room = int(max_nodes) - sum(2 * len(r.seq) for r in live)
        kept: list[list[int]] = []
        finished = [s for s in old.seqs if id(s) not in live_ids]
        for seq in reversed(finished):
            if 2 * len(seq) > room:
                break
            room -= 2 * len(seq)
            kept.append(seq)
        new = self._new_tree()
        new.active = old.active
        self._trees[key] = new                   # an existing key keeps its place in the LRU order
        self._nodes -= old.nodes
        self._drop_tree(old)
        for seq in reversed(kept):
            new.seqs.append([])
            self._append(new, new.seqs[-1], new.root, new.root, seq)
            new.seq_bytes += sequences_bytes(new.seqs[-1:])
        for req in live:
            stored, req.tree, req.seq = req.seq, new, []
            new.seqs.append(req.seq)
            req.last, req.anchor, done = self._append(new, req.seq, new.root, new.root, stored)
            if done < len(stored):
                req.tail = stored[done:] + (req.tail or [])
        return len(finished) - len(kept)

    def count(self, key: str, tokens: Sequence[int]) -> int:
        """Occurrences of the substring `tokens` in the key's sequences: the trie node's count
        (0 if absent, empty, or longer than max_depth)."""
        tree = self._trees.get(key)
        if tree is None or not 0 < len(tokens) <= self.max_depth:
            return 0
        v = 0
        for c in tokens:
            v = tree.trans[v].get(int(c))
            if v is None:
                return 0
        return tree.cnt[v]

    def children(self, key: str, tokens: Sequence[int]) -> dict[int, int]:
        """The trie node's children for the substring `tokens`: {next token: count of tokens + [next]}
        ({} if absent or at depth max_depth). `tokens` = () gives the key's first-level nodes."""
        tree = self._trees.get(key)
        if tree is None or len(tokens) >= self.max_depth:
            return {}
        v = 0
        for c in tokens:
            v = tree.trans[v].get(int(c))
            if v is None:
                return {}
        return {c: tree.cnt[u] for c, u in sorted(tree.trans[v].items())}

    def nodes_of(self, key: str) -> int:
        """Automaton states of one key (0 if absent)."""
        tree = self._trees.get(key)
        return tree.nodes if tree is not None else 0

    def has_key(self, key) -> bool:
        return key in self._trees

    def keys(self) -> list[str]:
        """Keys in least-recently-used-first order."""
        return list(self._trees)

    # -- introspection -------------------------------------------------------
    def stats(self) -> dict:
        """sizes(), and counts that walk every stored sequence (tokens, sequences)."""
        trees = list(self._trees.values())
        return {
            **self.sizes(),
            "max_nodes": self.max_nodes,
            "tokens": sum(len(s) for t in trees for s in t.seqs),
            "sequences": sum(len(t.seqs) for t in trees),
            "active_requests": len(self._reqs),
            "frozen_requests": sum(1 for r in self._reqs.values() if r.tail is not None),
            "evicted_keys": self._evicted,
        }

    def sizes(self) -> dict:
        """keys, nodes and memory_bytes: what the engines report after every rollout, so without a walk
        over every stored sequence (the finished ones' bytes are kept per key as they finish, and a
        list the trees no longer extend keeps its size): it grew with every epoch's responses."""
        return {"keys": len(self._trees), "nodes": self._nodes,
                "memory_bytes": self._memory_bytes(list(self._trees.values()))}

    def _seqs_bytes(self, trees) -> list[int]:
        """sequences_bytes(t.seqs) for each tree: its finished sequences' (kept in `seq_bytes`) and
        those of its requests in flight (computed now: they still grow)."""
        live: dict[int, int] = {}
        for r in self._reqs.values():
            live[id(r.tree)] = live.get(id(r.tree), 0) + sequences_bytes([r.seq])
        return [t.seq_bytes + live.get(id(t), 0) for t in trees]

    def _memory_bytes(self, trees: list[_Tree]) -> int:
        """sys.getsizeof of the containers and roots, plus the per-state dicts and non-cached ints of
        about _MEM_SAMPLE non-root states (every step-th over all keys, at least one a key) scaled up
        to each key's size, plus the stored sequences (their non-cached token ints sampled)."""
        size = sys.getsizeof
        total = size(self) + size(self._trees) + size(self._reqs)
        total += sum(size(r) + (size(r.tail) if r.tail is not None else 0) for r in self._reqs.values())
        step = max(1, sum(len(t.length) for t in trees) // _MEM_SAMPLE)
        for t, seq_bytes in zip(trees, self._seqs_bytes(trees)):
            total += size(t) + size(t.seqs) + sum(map(size, (t.trans, t.link, t.length, t.cnt, t.utok, t.ustate)))
            total += size(t.trans[0])                # the root: the largest dict, counted exactly
            n = len(t.length) - 1
            if n == 0:
                continue
            sample = range(1 + min(n - 1, step // 2), n + 1, step)
            per = 0
            for i in sample:
                per += size(t.trans[i])
                for x in (t.link[i], t.length[i], t.cnt[i]):
                    if not -5 <= x <= 256:           # CPython caches small ints
                        per += size(x)
            total += per * n // len(sample)
            total += seq_bytes
        return int(total)

    # -- persistence ---------------------------------------------------------
    def state_dict(self) -> dict:
        """numpy arrays + json-able values: config, keys (LRU order) and every stored sequence."""
        keys = list(self._trees)
        seqs = [s for k in keys for s in self._trees[k].seqs]
        flat = [x for s in seqs for x in s]
        return {
            "format": _FORMAT,
            "config": {"max_depth": self.max_depth, "max_match": self.max_match, "max_nodes": self.max_nodes},
            "keys": keys,
            "key_num_seqs": np.array([len(self._trees[k].seqs) for k in keys], dtype=np.int64),
            "seq_lengths": np.array([len(s) for s in seqs], dtype=np.int64),
            "tokens": np.array(flat, dtype=np.int64),
        }

    @classmethod
    def from_state_dict(cls, state: dict, max_depth: int | None = None, max_match: int | None = None,
                        max_nodes: int | None = None) -> DraftTrees:
        """The trees of `state`, rebuilt under its own bounds, or under the ones given: a resumed run's
        current settings, which may differ from the crashed run's (a smaller max_nodes evicts the
        least recently used keys while rebuilding)."""
        if state.get("format") != _FORMAT:
            raise ValueError(f"not a draft-trees state (format {state.get('format')!r}, expected {_FORMAT!r})")
        cfg = state["config"]
        trees = cls(max_depth=cfg["max_depth"] if max_depth is None else max_depth,
                    max_match=cfg["max_match"] if max_match is None else max_match,
                    max_nodes=cfg["max_nodes"] if max_nodes is None else max_nodes)
        keys = list(state["keys"])
        per_key = np.asarray(state["key_num_seqs"], dtype=np.int64)
        lengths = np.asarray(state["seq_lengths"], dtype=np.int64)
        tokens = np.asarray(state["tokens"], dtype=np.int64)
        if (len(per_key) != len(keys) or int(per_key.sum()) != len(lengths)
                or int(lengths.sum()) != len(tokens) or (lengths < 0).any() or (per_key < 0).any()
                or len(set(keys)) != len(keys)):
            raise ValueError("draft-trees state is inconsistent: key, sequence and token counts disagree "
                             "(or a key repeats)")
        flat = tokens.tolist()
        offsets = np.concatenate([[0], np.cumsum(lengths)]).tolist()
        i = 0
        for key, n in zip(keys, per_key.tolist()):
            tree = trees._tree(str(key), use=False)
            for _ in range(n):
                seq = flat[offsets[i]:offsets[i + 1]]
                tree.seqs.append([])
                if seq:
                    trees._append(tree, tree.seqs[-1], tree.root, tree.root, seq)
                tree.seq_bytes += sequences_bytes(tree.seqs[-1:])
                i += 1
        return trees

    def save(self, directory: str | Path) -> None:
        self.save_state(self.state_dict(), directory)

    @classmethod
    def load(cls, directory: str | Path) -> "DraftTrees":
        state = cls.load_state(directory)
        try:
            return cls.from_state_dict(state)
        except Exception as e:
            raise RuntimeError(f"draft trees in {directory} are corrupt: {type(e).__name__}: {e}") from None

    @staticmethod
    def save_state(state: dict, directory: str | Path) -> None:
        """Write a state_dict (e.g. fetched from an engine) without building the trees here."""
        d = Path(directory)
        d.mkdir(parents=True, exist_ok=True)
        np.savez(d / _NPZ, **{k: state[k] for k in _ARRAYS})
        # format, config, keys, and what a caller keeps beside the trees (the drafter's calibration)
        meta = {k: (list(v) if k == "keys" else v) for k, v in state.items() if k not in _ARRAYS}
        (d / _JSON).write_text(json.dumps(meta))

    @staticmethod
    def load_state(directory: str | Path) -> dict:
        """Read what save_state wrote, as a state_dict (checked when the trees are built from it)."""
        d = Path(directory)
        try:
            meta = json.loads((d / _JSON).read_text())
            with np.load(d / _NPZ) as arrays:
                return dict(meta, **{k: arrays[k] for k in _ARRAYS})
        except Exception as e:
            raise RuntimeError(f"draft trees in {d} are missing or corrupt: {type(e).__name__}: {e}") from None

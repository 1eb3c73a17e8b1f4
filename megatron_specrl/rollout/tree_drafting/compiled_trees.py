"""The draft trees' automata compiled: the same suffix automata as rollout.tree_drafting.trees, in numpy arrays
driven by numba, for engines where the drafter runs between forwards that take milliseconds.

Why: the pure-Python automaton costs 40-47 us per request and engine step inside vLLM on this CPU
(docs/benchmarks/), most of it extending two automata by a token or two and walking a draft. On
a GPU a decode step of a few hundred requests takes a few tens of ms, so a drafter at that price
would take a large share of the step. Here extending and proposing are compiled loops over arrays;
what is left per call is numba's dispatch (about 1 us) and the Python bookkeeping the two
implementations share. Measured in vLLM on the same tokens: 20-21 us per request and step against
41-49 us for the Python automata (docs/benchmarks/2026-11-23-avx512.md).

`CompiledDraftTrees` subclasses `DraftTrees` and keeps all of its bookkeeping (keys and their LRU
order, eviction, frozen requests, `keep_newest`, persistence): only the automaton's storage, its
construction (`_feed_tree`) and its reads (proposals, matches, counts) are replaced. The construction
is the same algorithm step for step, so both give the same states, counts, proposals and scores
(tests/unit/rollout/test_draft_tree.py runs every test on both, and tests/unit/rollout/test_draft_tree_compiled.py drives
both with the same random operations and compares every proposal).

Storage: one pool of states for all keys, each key an automaton under its own root:
- ``st[state]`` = (suffix link, length, count, only child's token or -1, only child's state, first
  edge, number of children, owning tree's slot), int32;
- ``ed[edge]`` = (source state, token, target state, next edge of the source), int32: a state's
  children are a linked list, read when a walk meets a state with several children or a state is
  cloned;
- ``ht``: an open-addressing table (linear probing, at most half full) from (state, token) to edge,
  the transition lookup of every appended token.
Arrays grow by doubling; the construction stops before a token when the free room could run out
(a token adds at most 2 states and, along its suffix-link chain, at most length(last) + 1 edges plus
a split clone's children) and resumes once they have grown. A tree that leaves (eviction,
`keep_newest`) leaves its states behind as garbage; once the garbage outweighs the live states, the
pool is compacted (live states copied in order, edges re-linked, requests re-pointed) when the next
tree is created.
"""

from __future__ import annotations

import sys

import numpy as np
from numba import njit

from megatron_specrl.rollout.tree_drafting.trees import DraftTrees

# st columns
LINK, LEN, CNT, UTOK, USTATE, HEAD, NCHILD, OWNER = range(8)
# ed columns
SRC, TOK, DST, NEXT = range(4)
# meta: states, edges, most children of any state
N_STATES, N_EDGES, MAX_CHILDREN = range(3)

_GOLDEN = np.uint64(0x9E3779B97F4A7C15)
_MIX = np.uint64(0xC2B2AE3D27D4EB4F)


@njit(cache=True, inline="always")
def _slot(s, c, mask):
    x = np.uint64(s) * _GOLDEN + np.uint64(c) * _MIX
    x ^= x >> np.uint64(29)
    return np.int64(x & np.uint64(mask))


@njit(cache=True, inline="always")
def _key(s, c):
    """(state, token) as one int64: the token's low 32 bits, so that a negative token (the Python trees
    take any int) cannot overwrite the state with its sign bits nor make the key -1, the empty slot."""
    return (np.int64(s) << 32) | (np.int64(c) & np.int64(0xFFFFFFFF))


@njit(cache=True, inline="always")
def _get(ht, s, c):
    """The edge for transition (s, c), -1 if none."""
    mask = ht.shape[0] - 1
    key = _key(s, c)
    i = _slot(s, c, mask)
    while True:
        k = ht[i, 0]
        if k == key:
            return ht[i, 1]
        if k == -1:
            return -1
        i = (i + 1) & mask


@njit(cache=True, inline="always")
def _put(ht, s, c, e):
    mask = ht.shape[0] - 1
    i = _slot(s, c, mask)
    while ht[i, 0] != -1:
        i = (i + 1) & mask
    ht[i, 0] = _key(s, c)
    ht[i, 1] = e


@njit(cache=True, inline="always")
def _new_state(st, meta, link, length, cnt, owner):
    s = meta[N_STATES]
    meta[N_STATES] = s + 1
    st[s, LINK] = link
    st[s, LEN] = length
    st[s, CNT] = cnt
    st[s, UTOK] = -1
    st[s, USTATE] = 0
    st[s, HEAD] = -1
    st[s, NCHILD] = 0
    st[s, OWNER] = owner
    return s


@njit(cache=True, inline="always")
def _add_edge(st, ed, ht, meta, p, c, t):
    e = meta[N_EDGES]
    meta[N_EDGES] = e + 1
    ed[e, SRC] = p
    ed[e, TOK] = c
    ed[e, DST] = t
    ed[e, NEXT] = st[p, HEAD]
    st[p, HEAD] = e
    n = st[p, NCHILD] + 1
    st[p, NCHILD] = n
    if n > meta[MAX_CHILDREN]:
        meta[MAX_CHILDREN] = n
    if n == 1:
        st[p, UTOK] = c
        st[p, USTATE] = t
    else:
        st[p, UTOK] = -1
    _put(ht, p, c, e)


@njit(cache=True)
def _split(st, ed, ht, meta, q, new_length, p, c):
    """rollout.tree_drafting.trees._split: clone q with the strings of length <= new_length, redirect the
    c-transitions into q along p's suffix links to the clone, make it q's link."""
    clone = _new_state(st, meta, st[q, LINK], new_length, st[q, CNT], st[q, OWNER])
    e = st[q, HEAD]
    while e != -1:
        _add_edge(st, ed, ht, meta, clone, ed[e, TOK], ed[e, DST])
        e = ed[e, NEXT]
    while p != -1:
        e = _get(ht, p, c)
        if e == -1 or ed[e, DST] != q:
            break
        ed[e, DST] = clone
        if st[p, UTOK] >= 0:
            st[p, USTATE] = clone
        p = st[p, LINK]
    st[q, LINK] = clone
    return clone


@njit(cache=True)
def _feed(st, ed, ht, meta, root, last, anchor, n, tokens, room, depth):
    """rollout.tree_drafting.trees._feed over the pool: append `tokens` to a sequence of length n of the tree
    under `root`. Returns (last, anchor, tokens appended, 1 if it stopped for array capacity)."""
    limit = meta[N_STATES] + room - 2
    dm1 = depth - 1
    done = 0
    for i in range(tokens.shape[0]):
        s_total = meta[N_STATES]
        if s_total > limit:
            return last, anchor, done, 0
        if (st.shape[0] - s_total < 2
                or ed.shape[0] - meta[N_EDGES] < st[last, LEN] + 2 + meta[MAX_CHILDREN]
                or 2 * (meta[N_EDGES] + st[last, LEN] + 2 + meta[MAX_CHILDREN]) > ht.shape[0]):
            return last, anchor, done, 1
        c = tokens[i]
        e = _get(ht, last, c)
        if e != -1:                              # the string + c already occurs (generalized case)
            q = ed[e, DST]
            lc = st[last, LEN] + 1
            if st[q, LEN] == lc:
                cur = q
            else:
                cur = _split(st, ed, ht, meta, q, lc, last, c)
        else:
            cur = _new_state(st, meta, root, st[last, LEN] + 1, 0, st[root, OWNER])
            p = last
            while p != -1 and _get(ht, p, c) == -1:
                _add_edge(st, ed, ht, meta, p, c, cur)
                p = st[p, LINK]
            if p != -1:
                q = ed[_get(ht, p, c), DST]
                lp = st[p, LEN] + 1
                if st[q, LEN] == lp:
                    st[cur, LINK] = q
                else:
                    st[cur, LINK] = _split(st, ed, ht, meta, q, lp, p, c)
        n += 1
        if n <= depth:
            anchor = cur
        else:                                    # old suffix of length depth - 1, then + c
            while st[st[anchor, LINK], LEN] >= dm1:
                anchor = st[anchor, LINK]
            anchor = ed[_get(ht, anchor, c), DST]
        v = anchor
        while v != root:                         # one more occurrence of each short suffix
            st[v, CNT] += 1
            v = st[v, LINK]
        last = cur
        done += 1
    return last, anchor, done, 0


@njit(cache=True)
def _walk(st, ed, v, m, max_tokens, max_depth, min_prob, kappa, out):
    """DraftTrees._propose_from's walk from the match (state v, length m): (tokens, score, first token,
    its frequency)."""
    room = max_depth - m
    if max_tokens > room:
        max_tokens = room
    if max_tokens <= 0 or min_prob > 1.0:
        return 0, 0.0, -1, 0.0
    prob = 1.0
    score = 0.0
    k = 0
    ftok = -1
    fp = 0.0
    for i in range(max_tokens):
        c = st[v, UTOK]
        if c >= 0:                               # one child: frequency 1
            if i == 0:
                ftok = c
                fp = 1.0
            if kappa != 1.0:
                prob *= kappa
                if prob < min_prob:
                    break
            out[k] = c
            k += 1
            score += prob
            v = st[v, USTATE]
            continue
        e = st[v, HEAD]
        if e == -1:
            break
        best = -1
        bc = 0
        tot = 0
        bu = -1
        while e != -1:
            u = ed[e, DST]
            cnt = st[u, CNT]
            t = ed[e, TOK]
            tot += cnt
            if cnt > bc or (cnt == bc and t < best):
                bc = cnt
                best = t
                bu = u
            e = ed[e, NEXT]
        if i == 0:
            ftok = best
            fp = bc / tot
        if kappa != 1.0:
            prob *= kappa * bc / tot
        else:
            prob *= bc / tot
        if prob < min_prob:
            break
        out[k] = best
        k += 1
        score += prob
        v = bu
    return k, score, ftok, fp


@njit(cache=True)
def _propose(st, ed, root, anchor, max_match, max_depth, max_tokens, min_prob, kappa, out):
    v = anchor                                   # suffix of length min(len, max_depth) ...
    if v == root:
        return 0, 0.0, -1, 0.0
    while st[st[v, LINK], LEN] >= max_match:     # ... -> of length min(len, max_match)
        v = st[v, LINK]
    while v != root and st[v, NCHILD] == 0:      # shorter until one has a continuation
        v = st[v, LINK]
    if v == root:
        return 0, 0.0, -1, 0.0
    m = min(st[v, LEN], max_match)
    return _walk(st, ed, v, m, max_tokens, max_depth, min_prob, kappa, out)


@njit(cache=True)
def _fits(st, ed, ht, meta, last, n):
    """Whether appending n tokens to the sequence in state `last` surely fits the arrays: 2 states a
    token; a token's edges at most length(last) + 1 along its suffix-link chain plus a clone's
    children, where length(last) grows by one and the most children by at most one a token."""
    if st.shape[0] - meta[N_STATES] < 2 * n:
        return False
    edges = n * (st[last, LEN] + 2 * n + 2 + meta[MAX_CHILDREN])
    return ed.shape[0] - meta[N_EDGES] >= edges and 2 * (meta[N_EDGES] + edges) <= ht.shape[0]


@njit(cache=True)
def _feed_propose(st, ed, ht, meta, two, root0, last0, anchor0, n0, root1, last1, anchor1, n1, tokens,
                  depth, max_match, max_tokens, min_prob, kappa0, kappa1, out0, out1, firsts):
    """DraftTrees.extend_and_propose for one request or two (`two`) in one call, when they surely fit
    the arrays (else status 1 and nothing done): feed both, propose from both, keep the second's draft
    when it differs and scores at least as high. Returns (status, last0, anchor0, made0, last1,
    anchor1, made1, draft length, source); the draft is in out0 (source 0) or out1 (source 1), each
    request's first token and its frequency in firsts[i] = (token, frequency), token -1 for none."""
    n = tokens.shape[0]
    if n and not (_fits(st, ed, ht, meta, last0, 2 * n) and (not two or _fits(st, ed, ht, meta, last1, 2 * n))):
        return 1, last0, anchor0, 0, last1, anchor1, 0, 0, 0
    big = np.int64(1) << 62
    s0 = meta[N_STATES]
    if n:
        last0, anchor0, _, _ = _feed(st, ed, ht, meta, root0, last0, anchor0, n0, tokens, big, depth)
    s1 = meta[N_STATES]
    if n and two:
        last1, anchor1, _, _ = _feed(st, ed, ht, meta, root1, last1, anchor1, n1, tokens, big, depth)
    made0 = s1 - s0
    made1 = meta[N_STATES] - s1
    k0, score0, ftok, fp = _propose(st, ed, root0, anchor0, max_match, depth, max_tokens, min_prob, kappa0, out0)
    firsts[0, 0] = ftok
    firsts[0, 1] = fp
    if not two:
        return 0, last0, anchor0, made0, last1, anchor1, 0, k0, 0
    k1, score1, ftok, fp = _propose(st, ed, root1, anchor1, max_match, depth, max_tokens, min_prob, kappa1, out1)
    firsts[1, 0] = ftok
    firsts[1, 1] = fp
    source = 0
    if score1 >= score0:
        same = k0 == k1
        if same:
            for i in range(k0):
                if out0[i] != out1[i]:
                    same = False
                    break
        if not same:
            source = 1
    return 0, last0, anchor0, made0, last1, anchor1, made1, k1 if source else k0, source


@njit(cache=True)
def _match_propose(st, ed, ht, root, ctx, max_depth, max_tokens, min_prob, kappa, out):
    """Match the context (the last max_match tokens) from scratch, then walk: DraftTrees._match."""
    v = root
    n = 0
    for i in range(ctx.shape[0]):
        c = ctx[i]
        while v != root and _get(ht, v, c) == -1:
            v = st[v, LINK]
            n = st[v, LEN]
        e = _get(ht, v, c)
        if e != -1:
            v = ed[e, DST]
            n += 1
    while v != root and st[v, NCHILD] == 0:
        v = st[v, LINK]
        n = st[v, LEN]
    if v == root:
        return 0, 0.0, -1, 0.0
    return _walk(st, ed, v, n, max_tokens, max_depth, min_prob, kappa, out)


@njit(cache=True)
def _follow(ht, ed, root, tokens):
    """The state reached from root by `tokens`, -1 if a transition is missing."""
    v = root
    for i in range(tokens.shape[0]):
        e = _get(ht, v, tokens[i])
        if e == -1:
            return -1
        v = ed[e, DST]
    return v


@njit(cache=True)
def _rehash(ed, n_edges, ht):
    for e in range(n_edges):
        _put(ht, ed[e, SRC], ed[e, TOK], e)


@njit(cache=True)
def _compact(st, ed, meta, alive, new_st, new_ed, new_ht, new_meta):
    """Copy the states of live trees (alive[owner]) and their edges into the new arrays, in order;
    returns old state -> new state (-1 for garbage)."""
    n = meta[N_STATES]
    remap = np.full(n, -1, np.int64)
    j = 0
    for s in range(n):
        if alive[st[s, OWNER]]:
            remap[s] = j
            j += 1
    for s in range(n):
        t = remap[s]
        if t < 0:
            continue
        link = st[s, LINK]
        new_st[t, LINK] = remap[link] if link >= 0 else -1
        new_st[t, LEN] = st[s, LEN]
        new_st[t, CNT] = st[s, CNT]
        new_st[t, UTOK] = -1
        new_st[t, USTATE] = 0
        new_st[t, HEAD] = -1
        new_st[t, NCHILD] = 0
        new_st[t, OWNER] = st[s, OWNER]
    new_meta[N_STATES] = j
    new_meta[N_EDGES] = 0
    new_meta[MAX_CHILDREN] = 0
    for e in range(meta[N_EDGES]):
        p = remap[ed[e, SRC]]
        if p >= 0:
            _add_edge(new_st, new_ed, new_ht, new_meta, p, ed[e, TOK], remap[ed[e, DST]])
    return remap


def _table_for(edges: int) -> np.ndarray:
    size = 1 << max(4, int(2 * edges - 1).bit_length())   # a power of two >= 2 x edges
    return np.full((size, 2), -1, np.int64)


class _Key:
    """One key's automaton in the pool: its root state and the bookkeeping DraftTrees keeps per tree."""

    __slots__ = ("root", "slot", "seqs", "active", "nodes", "seq_bytes")

    def __init__(self, root: int, slot: int):
        self.root = root
        self.slot = slot
        self.seqs: list[list[int]] = []
        self.active = 0
        self.nodes = 0        # states of this key, its root not counted
        self.seq_bytes = 0    # sequences_bytes of its finished sequences (DraftTrees keeps it)


class CompiledDraftTrees(DraftTrees):
    """DraftTrees with the automata in numpy arrays built and read by numba (module docstring)."""

    compiled = True                 # TreeProposer loads the kernels when its engine starts

    compact_min_garbage = 1 << 16   # garbage states below which the pool is never compacted
    initial_states = 1024           # the arrays' first sizes (edges: twice that)

    def __init__(self, max_depth: int = 32, max_match: int = 16, max_nodes: int = 2_000_000):
        super().__init__(max_depth=max_depth, max_match=max_match, max_nodes=max_nodes)
        self._st = np.zeros((self.initial_states, 8), np.int32)
        self._ed = np.zeros((2 * self.initial_states, 4), np.int32)
        self._ht = _table_for(len(self._ed))
        self._meta = np.zeros(3, np.int64)
        self._alive = np.zeros(64, np.bool_)
        self._slots = 0
        self._garbage = 0        # states of trees that left the pool
        self._compactions = 0
        self._out = np.zeros(self.max_depth + 1, np.int32)
        self._out1 = np.zeros(self.max_depth + 1, np.int32)
        self._no_tokens = np.zeros(0, np.int32)
        self._firsts = np.zeros((2, 2), np.float64)     # each source's first token and its frequency

    # -- storage hooks -------------------------------------------------------------------------
    def _new_tree(self) -> _Key:
        if self._garbage > max(self._meta[N_STATES] - self._garbage, self.compact_min_garbage):
            self._compact()
        slot = self._slots
        self._slots += 1
        if slot >= len(self._alive):
            self._alive = np.concatenate([self._alive, np.zeros(len(self._alive), np.bool_)])
        self._alive[slot] = True
        if self._meta[N_STATES] >= len(self._st):
            self._grow(states=True)
        root = int(self._meta[N_STATES])
        self._meta[N_STATES] += 1
        self._st[root] = (-1, 0, 0, -1, 0, -1, 0, slot)
        return _Key(root, slot)

    def _drop_tree(self, tree: _Key) -> None:
        self._alive[tree.slot] = False
        self._garbage += tree.nodes + 1

    def _feed_tree(self, tree: _Key, last: int, anchor: int, n: int, tokens, room: int):
        toks = np.asarray(tokens, dtype=np.int32)
        s0 = int(self._meta[N_STATES])
        done = 0
        while True:
            last, anchor, k, full = _feed(self._st, self._ed, self._ht, self._meta, tree.root, last, anchor,
                                          n + done, toks[done:] if done else toks,
                                          room - (int(self._meta[N_STATES]) - s0), self.max_depth)
            done += k
            if not full:
                break
            self._grow(states=len(self._st) - self._meta[N_STATES] < 2)
        made = int(self._meta[N_STATES]) - s0
        tree.nodes += made
        return last, anchor, done, made

    def _grow(self, states: bool) -> None:
        """Double the state or the edge arrays (the hash table with the edges)."""
        if states:
            self._st = np.concatenate([self._st, np.zeros_like(self._st)])
            return
        self._ed = np.concatenate([self._ed, np.zeros_like(self._ed)])
        self._ht = _table_for(len(self._ed))
        _rehash(self._ed, int(self._meta[N_EDGES]), self._ht)

    def _compact(self) -> None:
        """Copy the live trees' states into fresh arrays and re-point roots and requests."""
        live = int(self._meta[N_STATES]) - self._garbage
        st = np.zeros((max(self.initial_states, 2 * live), 8), np.int32)
        ed = np.zeros((max(2 * self.initial_states, int(self._meta[N_EDGES])), 4), np.int32)
        ht = _table_for(len(ed))
        meta = np.zeros(3, np.int64)
        remap = _compact(self._st, self._ed, self._meta, self._alive, st, ed, ht, meta)
        self._st, self._ed, self._ht, self._meta, self._garbage = st, ed, ht, meta, 0
        self._compactions += 1
        for tree in self._trees.values():
            tree.root = int(remap[tree.root])
        for req in self._reqs.values():
            req.last, req.anchor = int(remap[req.last]), int(remap[req.anchor])

    # -- reads ---------------------------------------------------------------------------------
    def _propose_from(self, request_id, max_tokens: int, min_prob: float, kappa: float):
        req = self._reqs[request_id]
        self._trees.move_to_end(req.key)
        tree = req.tree
        out = self._out
        if max_tokens > len(out):
            out = self._out = np.zeros(max_tokens, np.int32)
            self._out1 = np.zeros(max_tokens, np.int32)
        if req.tail is None:
            k, score, ftok, fp = _propose(self._st, self._ed, tree.root, req.anchor, self.max_match, self.max_depth,
                                          max_tokens, min_prob, float(kappa), out)
        else:
            k, score, ftok, fp = _match_propose(self._st, self._ed, self._ht, tree.root,
                                                np.asarray(self._context(req), np.int32),
                                                self.max_depth, max_tokens, min_prob, float(kappa), out)
        return out[:k].tolist(), score, (int(ftok), float(fp))

    def extend_and_propose(self, request_ids, tokens, max_tokens: int, min_prob: float = 0.1, kappas=None):
        """DraftTrees.extend_and_propose; for one request or the pair TreeDrafter asks for (the prompt's
        tree and the shared tree) one compiled call, when no request is frozen and the size bound
        cannot be reached by this call (the general path runs otherwise, evicting as DraftTrees does)."""
        n, two = len(tokens), len(request_ids) == 2
        if not 0 < len(request_ids) <= 2 or self._nodes + 4 * n > self.max_nodes or max_tokens > len(self._out):
            return super().extend_and_propose(request_ids, tokens, max_tokens, min_prob, kappas)
        r0, r1 = self._reqs[request_ids[0]], self._reqs[request_ids[-1]]
        if r0.tail is not None or r1.tail is not None:
            return super().extend_and_propose(request_ids, tokens, max_tokens, min_prob, kappas)
        k0, k1 = (1.0, 1.0) if kappas is None else (float(kappas[0]), float(kappas[-1]))
        firsts = self._firsts
        status, last0, anchor0, made0, last1, anchor1, made1, k, source = _feed_propose(
            self._st, self._ed, self._ht, self._meta, two, r0.tree.root, r0.last, r0.anchor, len(r0.seq),
            r1.tree.root, r1.last, r1.anchor, len(r1.seq), np.asarray(tokens, np.int32) if n else self._no_tokens,
            self.max_depth, self.max_match, max_tokens, min_prob, k0, k1, self._out, self._out1, firsts)
        if status:                               # the arrays must grow first: the general path does
            return super().extend_and_propose(request_ids, tokens, max_tokens, min_prob, kappas)
        for req, last, anchor, made in ((r0, last0, anchor0, made0), (r1, last1, anchor1, made1))[:1 + two]:
            req.last, req.anchor = last, anchor
            if n:
                req.tree.nodes += made
                self._nodes += made
                req.seq.extend(tokens)
            self._trees.move_to_end(req.key)
        first = tuple((int(firsts[i, 0]), float(firsts[i, 1])) for i in range(1 + two))
        return (self._out1 if source else self._out)[:k].tolist(), source, first

    def _state_of(self, key: str, tokens) -> int:
        tree = self._trees.get(key)
        if tree is None:
            return -1
        return int(_follow(self._ht, self._ed, tree.root, np.asarray([int(t) for t in tokens], np.int32)))

    def count(self, key: str, tokens) -> int:
        if not 0 < len(tokens) <= self.max_depth:
            return 0
        v = self._state_of(key, tokens)
        return int(self._st[v, CNT]) if v >= 0 else 0

    def children(self, key: str, tokens) -> dict[int, int]:
        if len(tokens) >= self.max_depth:
            return {}
        v = self._state_of(key, tokens)
        if v < 0:
            return {}
        out, e = {}, int(self._st[v, HEAD])
        while e != -1:
            out[int(self._ed[e, TOK])] = int(self._st[self._ed[e, DST], CNT])
            e = int(self._ed[e, NEXT])
        return dict(sorted(out.items()))

    def _memory_bytes(self, trees) -> int:
        """The pool's arrays (their allocated size) plus the stored sequences, as DraftTrees counts them."""
        size = sys.getsizeof
        total = size(self) + size(self._trees) + size(self._reqs)
        total += sum(a.nbytes for a in (self._st, self._ed, self._ht, self._meta, self._alive, self._out, self._out1))
        total += sum(size(r) + (size(r.tail) if r.tail is not None else 0) for r in self._reqs.values())
        for t, seq_bytes in zip(trees, self._seqs_bytes(trees)):
            total += size(t) + size(t.seqs) + seq_bytes
        return int(total)


def load_kernels() -> None:
    """Compile (first use ever) or load from numba's cache (~0.5 s) the kernels of the hot paths, on
    throwaway trees: an engine calls this when it starts, so that its first rollout does not pay it."""
    trees = CompiledDraftTrees(max_depth=8, max_match=4, max_nodes=100_000)
    trees.insert("k", [1, 2, 3, 1, 2, 4])
    trees.insert("g", [(7 * i) % 1009 for i in range(3 * CompiledDraftTrees.initial_states)])   # the arrays grow
    trees.start("r", "k", [1])
    trees.start("s", "k", [1])
    trees.extend_and_propose(["r", "s"], [2], 4, 0.1, kappas=(1.0, 0.5))
    trees.extend_and_propose(["r"], [3], 4)
    trees.propose_scored("r", 4, 0.1)
    trees.finish("r")
    trees.finish("s")
    trees.keep_newest("k", 4)

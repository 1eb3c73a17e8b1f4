"""Tree drafting (rollout.draft=tree, docs/concepts/tree_drafting.md): the engine-independent parts of the
mechanism, in one place and inside the speculative core's import rules (no engine, vLLM, SGLang, Ray or
Megatron: tests/helpers/import_graph.py).

- trees.py: the per-prompt draft trees (suffix automata; standard library and numpy), and their file format;
- compiled_trees.py: the same automata in numpy arrays built and read by numba (rollout.drafter.impl);
- drafter.py: what an engine step does with the trees (which request drafts from which tree, draft lengths,
  calibration, counters) and the request keys and settings the engines hand over;
- checkpoint.py: the engines' trees saved into a run's checkpoint and restored from it.

Each engine's adaptor lives with the engine: vLLM's `custom_class` proposer is
engines/vllm/tree_proposer.py, SGLang's NGRAM worker patch is patches/sglang_0_5_23_tree_proposer.py.
"""

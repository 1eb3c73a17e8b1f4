"""A training run outside its step: what it holds (state.Run), how it is built (build), resumed and
checkpointed (checkpointing), recovered when an engine dies (recovery) and evaluated (evaluation)."""

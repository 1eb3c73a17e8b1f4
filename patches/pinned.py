"""One mechanism for the version-pinned vLLM patches: replace named attributes of one vLLM object
(a class or a module) with ours, only on the vLLM release the replacements were written against,
idempotently, and reversibly (tests revert to prove what a patch changes)."""

from __future__ import annotations

from typing import Callable, Iterable


class PinnedPatch:
    def __init__(self, version: str, owner: Callable[[], object], names: Iterable[str],
                 make: Callable[[dict], dict], when: Callable[[], bool] = lambda: True):
        """`owner()` imports and returns the patched object; `make(originals)` returns
        {name: replacement} given {name: vLLM's attribute}; `when()` gates it (a platform, an env var)."""
        self.version, self.owner, self.names, self.make, self.when = version, owner, tuple(names), make, when
        self._originals: dict | None = None

    def apply(self) -> bool:
        """True once installed; False, and vLLM untouched, on another version or when `when()` says no."""
        import vllm
        if vllm.__version__.split("+")[0] != self.version or not self.when():
            return False
        if self._originals is None:
            obj = self.owner()
            originals = {n: getattr(obj, n) for n in self.names}
            for name, fn in self.make(originals).items():
                setattr(obj, name, fn)
            self._originals = originals
        return True

    def revert(self) -> None:
        if self._originals is not None:
            obj = self.owner()
            for name, fn in self._originals.items():
                setattr(obj, name, fn)
            self._originals = None

    def is_applied(self) -> bool:
        return self._originals is not None

    def original(self, name: str):
        """vLLM's own attribute while the patch is applied."""
        if self._originals is None:
            raise RuntimeError(f"patch of {name} is not applied")
        return self._originals[name]

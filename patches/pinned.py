"""One mechanism for the version-pinned engine patches: replace named attributes of one object of an
engine package (a class or a module; vLLM by default, SGLang with package="sglang") with ours, only
on the release the replacements were written against, idempotently, and reversibly (tests revert to
prove what a patch changes). A name the object lacks is added, and removed again on revert."""

from __future__ import annotations

from typing import Callable, Iterable


_MISSING = object()


class PinnedPatch:
    def __init__(self, version: str, owner: Callable[[], object], names: Iterable[str],
                 make: Callable[[dict], dict], when: Callable[[], bool] = lambda: True, package: str = "vllm"):
        """`owner()` imports and returns the patched object; `make(originals)` returns
        {name: replacement} given {name: the package's attribute}; `when()` gates it (a platform, an env var)."""
        self.version, self.owner, self.names, self.make, self.when = version, owner, tuple(names), make, when
        self.package = package
        self._originals: dict | None = None

    def apply(self) -> bool:
        """True once installed; False, and vLLM untouched, on another version or when `when()` says no."""
        import importlib
        pkg = importlib.import_module(self.package)
        if getattr(pkg, "__version__", "").split("+")[0] != self.version or not self.when():
            return False
        if self._originals is None:
            obj = self.owner()
            originals = {n: getattr(obj, n, _MISSING) for n in self.names}
            for name, fn in self.make(originals).items():
                setattr(obj, name, fn)
            self._originals = originals
        return True

    def revert(self) -> None:
        if self._originals is not None:
            obj = self.owner()
            for name, fn in self._originals.items():
                if fn is _MISSING:
                    delattr(obj, name)
                else:
                    setattr(obj, name, fn)
            self._originals = None

    def is_applied(self) -> bool:
        return self._originals is not None

    def original(self, name: str):
        """vLLM's own attribute while the patch is applied."""
        if self._originals is None:
            raise RuntimeError(f"patch of {name} is not applied")
        return self._originals[name]

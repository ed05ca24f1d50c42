"""Run a callback right after a module finishes importing, without importing it ourselves.

`when_imported(name, callback)` calls `callback(module)` at once if `name` is already in
`sys.modules`; otherwise a finder on `sys.meta_path` waits for the import of `name`, lets the
other finders locate it, and wraps the loader so the callback runs once the module's code has
executed. The finder removes itself after the last pending hook fired, so later imports pay
nothing. A failing callback only warns: it must never break the import it piggybacks on.
"""

from __future__ import annotations

import sys
import warnings
from collections.abc import Callable
from types import ModuleType

Callback = Callable[[ModuleType], None]

__all__ = ["when_imported"]


def _run(name: str, callbacks: list[Callback]) -> None:
    module = sys.modules.get(name)  # the module may have replaced itself (lazy modules do)
    for callback in callbacks:
        try:
            callback(module)
        except Exception as e:  # noqa: BLE001 (see the module docstring)
            warnings.warn(f"clover: hook after importing {name} failed: {e!r}", stacklevel=2)


class _HookedLoader:
    """Delegates everything to the real loader; runs the callbacks after `exec_module`."""

    def __init__(self, loader: object, name: str, callbacks: list[Callback]) -> None:
        self._loader = loader
        self._name = name
        self._callbacks = callbacks

    def create_module(self, spec: object) -> ModuleType | None:
        return self._loader.create_module(spec)

    def exec_module(self, module: ModuleType) -> None:
        self._loader.exec_module(module)
        _run(self._name, self._callbacks)

    def __getattr__(self, attr: str) -> object:  # get_source, get_resource_reader, ...
        return getattr(self._loader, attr)


class _PostImportFinder:
    """A meta path finder that never finds anything itself; it only wraps others' loaders."""

    def __init__(self) -> None:
        self.pending: dict[str, list[Callback]] = {}

    def find_spec(self, name: str, path: object = None, target: object = None) -> object:
        if name not in self.pending:
            return None
        for finder in sys.meta_path:
            find = getattr(finder, "find_spec", None)
            if finder is self or find is None:
                continue
            spec = find(name, path, target)
            if spec is not None:
                break
        else:
            return None
        if spec.loader is None or not hasattr(spec.loader, "exec_module"):
            return spec  # namespace packages and legacy loaders: leave them alone
        callbacks = self.pending.pop(name)
        if not self.pending and self in sys.meta_path:
            sys.meta_path.remove(self)
        spec.loader = _HookedLoader(spec.loader, name, callbacks)
        return spec


_finder = _PostImportFinder()


def when_imported(name: str, callback: Callback) -> None:
    """Call `callback(module)` once module `name` has been imported (now, if it already is)."""
    if name in sys.modules:
        _run(name, [callback])
        return
    _finder.pending.setdefault(name, []).append(callback)
    if _finder not in sys.meta_path:
        sys.meta_path.insert(0, _finder)

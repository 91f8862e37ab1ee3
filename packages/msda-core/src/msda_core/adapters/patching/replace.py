"""The replacements ``patch`` installs: one ``Site`` per module and function it serves, counting that module's calls
and verifying its first one; what a child, an attribute or a module-level name then holds; the process-wide table
of replaced names; and the lock that makes patch and unpatch atomic.

Counts and verification cover eager calls: a counter or state that dynamo saw change would recompile the graph on
every call, so inside torch.compile'd (or exported) code a site serves msda without counting or verifying.
"""

from __future__ import annotations

import functools
import inspect
import os
import threading
import warnings
import weakref

import torch

from ..nn import MultiScaleDeformableAttention
from . import forms, verify

_lock = threading.RLock()


def lock() -> threading.RLock:
    """Held by patch, unpatch and a revert: each sees and leaves the tables whole."""
    return _lock


def _new_lock() -> None:  # a fork taken while another thread held it must not leave the child blocked
    global _lock
    _lock = threading.RLock()


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_new_lock)


class Site:
    """One function as one patched module calls it: msda where the call's arguments are laid out as msda serves
    them (``check``), the original otherwise; counts both; on the first call msda serves, also runs the original
    on the same inputs (``verify``) and, if they differ, runs the original for good and warns."""

    def __init__(self, where: str, label: str, original, check, serve, *, verify: bool = True,
                 cast: torch.dtype | None = None, shared: GlobalName | None = None):
        self.where, self.label, self.original, self.check, self.serve = where, label, original, check, serve
        self.cast, self.shared = cast, shared
        self.calls = self.fallbacks = 0
        self.fallback_reason: str | None = None
        self.verification: str | None = None if verify else "not verified (verify=False)"
        self._reverted: str | None = None

    @property
    def reverted(self) -> str | None:
        """Why this site runs its original for good (a global's: for every module calling it), or None."""
        return self.shared.reverted if self.shared is not None else self._reverted

    @property
    def state(self) -> str:
        """Verified (with the measured difference), not verified (why) or not yet called."""
        if self.verification is not None:
            return self.verification
        return "not yet called" if self.calls == 0 else "not verified yet: no eager call on plain tensors so far"

    def __call__(self, *args, **kwargs):
        original = forms.entry(self.original)
        if self.reverted:
            return original(*args, **kwargs)
        reason = self.check(*args, **kwargs)
        eager = not torch.compiler.is_compiling()
        if reason:
            if eager:
                self.fallbacks, self.fallback_reason = self.fallbacks + 1, reason
            return original(*args, **kwargs)
        output = self._serve(args, kwargs)
        if eager:
            self.calls += 1
            if self.verification is None and verify.skip_reason(args, kwargs) is None:
                self._verify(original, args, kwargs, output)
                if self.reverted:
                    self.calls -= 1  # the caller gets the original's output
                    return original(*args, **kwargs)
        return output

    def apply(self, *args, **kwargs):  # Function-style originals are called as X.apply(...)
        return self(*args, **kwargs)

    def _serve(self, args, kwargs):
        device = None if self.cast is None else (args[0] if args else kwargs["value"]).device.type
        if device is None or not torch.is_autocast_enabled(device):
            return self.serve(*args, **kwargs)
        with torch.autocast(device, enabled=False):  # as custom_fwd(cast_inputs=...): cast floats, autocast off
            return self.serve(*map(self._cast, args), **{k: self._cast(v) for k, v in kwargs.items()})

    def _cast(self, x):
        is_cast = isinstance(x, torch.Tensor) and x.is_floating_point() and x.dtype != torch.float64
        return x.to(self.cast) if is_cast else x

    def _verify(self, original, args, kwargs, output) -> None:
        try:
            expected = verify.reference(original, args, kwargs)
        except Exception as error:  # e.g. a compiled extension that is not there: msda keeps serving
            self.verification = f"not verified: the original could not run ({type(error).__name__}: {error})"
            return
        worst, description = verify.compare(output, expected)
        if worst is not None and worst < 1:
            self.verification = f"verified on its first call: {description}"
            return
        reason = f"the original differs from msda on the first call from {self.where}: {description}"
        with lock():
            if self.shared is not None:
                self.shared.revert(reason)
            else:
                self._reverted = reason
        warnings.warn(f"msda_core.patch: {self.label}: {reason}. It runs its original from now on (the report "
                      f"lists it as left alone)", stacklevel=3)


class PatchedCore(MultiScaleDeformableAttention):
    """What replaces one of transformers' parameter-free cores: msda's module, holding the original (not as a
    submodule: the model's modules and state are as before) to verify against and to go back to."""

    def __init__(self, original: torch.nn.Module, where: str, backend: str, verify: bool):
        super().__init__(backend)
        serve = functools.partial(MultiScaleDeformableAttention.forward, self)
        self.site = Site(where, "child: replaced by msda_core.nn.MultiScaleDeformableAttention", original,
                         forms.check_child, serve, verify=verify)

    def forward(self, *args, **kwargs):
        return self.site(*args, **kwargs)


def attribute_site(original, found, where: str, backend: str, verify: bool) -> Site:
    """What replaces a per-instance core function (set on the instance)."""
    check, serve = found
    return Site(where, f"attribute: {forms.CORE_ATTRIBUTE}", original, check,
                functools.partial(serve, backend=backend), verify=verify)


class GlobalName:
    """What a replaced module-level name holds while any patched model uses it: each call goes to the ``Site`` of
    the patched module whose forward made it (its own count and verification), calls from anywhere else (and
    inside compiled code) to ``outside``."""

    def __init__(self, namespace: dict, name: str, found, backend: str):
        self.namespace, self.name, self.original = namespace, name, namespace[name]
        self.label = f"global: {namespace.get('__name__')}.{name}"
        self.check, serve = found
        self.serve, self.backend, self.cast = functools.partial(serve, backend=backend), backend, forms.CASTS.get(name)
        self.users = 0  # patched models using it
        self.reverted: str | None = None
        self._sites: dict = {}  # id(module) -> (weak reference to the module, its Site, its forward's code)
        self._forwards: dict = {}  # the code object of a patched module's forward -> how many sites use it
        self.outside = self.site("outside a patched module's forward", verify=True)

    def site(self, where: str, verify: bool) -> Site:
        return Site(where, self.label, self.original, self.check, self.serve, verify=verify, cast=self.cast,
                    shared=self)

    def add(self, module: torch.nn.Module, site: Site) -> None:
        code = forms.forward_code(module)
        self._sites[id(module)] = (weakref.ref(module), site, code)
        self._forwards[code] = self._forwards.get(code, 0) + 1

    def discard(self, site: Site) -> None:
        for key, (_, registered, code) in list(self._sites.items()):
            if registered is site:
                del self._sites[key]
                self._forwards[code] -= 1
                if not self._forwards[code]:
                    del self._forwards[code]

    def __call__(self, *args, **kwargs):
        site = self.outside if torch.compiler.is_compiling() else self._caller()
        return site(*args, **kwargs)

    def apply(self, *args, **kwargs):  # Function-style globals are called as X.apply(...)
        return self(*args, **kwargs)

    def _caller(self) -> Site:
        """The site of the patched module whose forward is calling (its frame is at most three up: this method's
        caller, ``apply``, the forward), else ``outside``."""
        frame = inspect.currentframe()
        try:
            for _ in range(4):
                frame = frame.f_back if frame is not None else None
                if frame is None:
                    break
                code = frame.f_code
                if code in self._forwards:
                    module = frame.f_locals.get(code.co_varnames[0]) if code.co_argcount else None
                    found = self._sites.get(id(module))
                    return found[1] if found is not None and found[0]() is module else self.outside
        finally:
            del frame
        return self.outside

    def revert(self, reason: str) -> None:
        """The original back in its namespace for good, for every model (called under the lock)."""
        self.reverted = reason
        key = (id(self.namespace), self.name)
        if _globals.get(key) is self:
            del _globals[key]
            self.namespace[self.name] = self.original
        refused[key] = reason


_globals: dict[tuple, GlobalName] = {}  # (id(namespace), name) -> the GlobalName it holds now
refused: dict = {}  # (id(namespace), name) -> why verification sent that name back to its original, for good


def acquire(namespace: dict, name: str, found, backend: str) -> GlobalName:
    """The GlobalName in ``namespace[name]``, installed if it is not yet; one more user."""
    key = (id(namespace), name)
    replacement = _globals.get(key)
    if replacement is None:
        replacement = _globals[key] = GlobalName(namespace, name, found, backend)
        namespace[name] = replacement
    elif replacement.backend != backend:
        raise ValueError(f"backend: expected {replacement.backend!r}, the backend another patched model runs "
                         f"{namespace.get('__name__')}.{name} with (one per process), got {backend!r}")
    replacement.users += 1
    return replacement


def original_of(namespace: dict, name: str):
    """What ``namespace[name]`` was before any patch."""
    replacement = _globals.get((id(namespace), name))
    return replacement.original if replacement is not None else namespace[name]


def release(acquired: list[tuple[GlobalName, Site]]) -> None:
    """Each (GlobalName, Site) a report acquired: the site forgotten, the name restored by its last user."""
    with lock():
        for replacement, site in reversed(acquired):
            replacement.discard(site)
            replacement.users -= 1
            key = (id(replacement.namespace), replacement.name)
            if replacement.users == 0 and _globals.get(key) is replacement:
                replacement.namespace[replacement.name] = replacement.original
                del _globals[key]
        acquired.clear()

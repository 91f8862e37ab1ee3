"""The backend registry: what each backend can take, and which one a call runs.

Backends live in other packages and are found through the entry-point group ``msda.backends``, so this
package never imports them by name. Each entry point names a :class:`Backend` object, or a :class:`LazyBackend`
that says where one is: its module is imported only when a call asks for it by name, or when ``"auto"``
considers it for a device in its ``auto_devices`` (so a CPU process never imports Triton).

Which backend a call asks for, first match wins: the op's ``backend=`` argument when it is not
``"auto"``, the innermost :func:`use_backend` scope of the calling thread or task, the ``MSDA_BACKEND``
environment variable, else ``"auto"``. ``"auto"`` takes the highest-priority backend that supports the
inputs and lists their device type in its ``auto_devices``.

A backend's ``forward(inputs)`` takes one :class:`Inputs`, the five tensors, and
``backward(grad_output, inputs, grad_accum, deterministic)`` returns the three gradients; selection and a
backend's ``limits`` see only :class:`Metadata`. (Backends written for 0.2.0 took the five tensors as separate
arguments: wrap them, ``forward=lambda inputs: old_forward(*inputs)``.)
"""

from __future__ import annotations

import contextlib
import contextvars
import importlib
import os
import threading
from collections.abc import Callable
from dataclasses import dataclass, field
from importlib.metadata import entry_points
from typing import NamedTuple

import torch

ENTRY_POINT_GROUP = "msda.backends"
ENV_VAR = "MSDA_BACKEND"
# The first-party backends and the package that provides each, for the error when one is not installed.
FIRST_PARTY = {"naive": "msda-reference", "grid_sample": "msda-reference", "gather": "msda-reference",
               "triton": "msda-triton"}


class Inputs(NamedTuple):
    """The op's five input tensors, in the op's order: what validation checks and every backend's forward and
    backward take (unpack with ``*inputs`` where a torch.library op needs them as separate tensors). A backend
    always gets a ``level_start_index`` tensor; only the public op's caller may pass None."""

    value: torch.Tensor  # (B, S, M, D)
    spatial_shapes: torch.Tensor  # (L, 2): (H, W) per level
    level_start_index: torch.Tensor  # (L,)
    sampling_locations: torch.Tensor  # (B, Q, M, L, P, 2): (x, y) in [0, 1]
    attention_weights: torch.Tensor  # (B, Q, M, L, P)


class Metadata(NamedTuple):
    """What selection may look at: metadata only, never tensor values, since selection also runs while
    torch.compile and torch.export trace the op. A named tuple: it is made and hashed on every call."""

    device: torch.device
    value_dtype: torch.dtype
    location_dtype: torch.dtype
    batch: int
    queries: int
    heads: int
    head_dim: int
    levels: int
    points: int
    grad_accum: str
    deterministic: bool  # a bitwise-reproducible backward is required

    @classmethod
    def of(cls, value: torch.Tensor, sampling_locations: torch.Tensor, grad_accum: str = "auto",
           deterministic: bool = False) -> Metadata:
        B, Q, M, L, P, _ = sampling_locations.shape
        return cls(value.device, value.dtype, sampling_locations.dtype, B, Q, M, value.shape[3], L, P, grad_accum,
                   deterministic)


@dataclass(frozen=True)
class Backend:
    """A named implementation of the op's forward and backward, with what it supports.

    ``traceable``: forward and backward are made of torch operations and ``torch.library.triton_op``s only
    and read no tensor's values on the host, so the op calls them directly and torch.compile, torch.export
    and AOTInductor see through them. Otherwise the op runs them inside its opaque private ops
    (``msda::_opaque_forward`` / ``_opaque_backward``), which tracing records as calls.
    """

    name: str
    forward: Callable[[Inputs], torch.Tensor]  # (inputs) -> out
    backward: Callable  # (grad_output, inputs, grad_accum, deterministic) -> (grad_value, grad_locations, grad_weights)
    devices: frozenset  # device types it runs on
    dtypes: frozenset  # dtypes of value it accepts
    auto_devices: frozenset = frozenset()  # device types on which "auto" may choose it
    priority: int = 0  # "auto" prefers higher
    traceable: bool = False
    reproducible_on: frozenset = frozenset()  # device types where its backward gives the same bits every run
    deterministic_on_request: bool = False  # deterministic=True makes its backward reproducible on any device
    honors_grad_accum: bool = False  # it scatters grad_value with atomic adds, in the dtype grad_accum picks
    limits: Callable[[Metadata], list] = field(default=lambda meta: [])  # further reasons it can't run

    def not_supported_reasons(self, meta: Metadata) -> list:
        reasons = []
        if meta.device.type not in self.devices:
            reasons.append(f"device type {meta.device.type!r} not in {sorted(self.devices)}")
        if meta.value_dtype not in self.dtypes:
            reasons.append(f"dtype {meta.value_dtype} not supported")
        if (meta.deterministic and meta.device.type not in self.reproducible_on
                and not self.deterministic_on_request):
            reasons.append(f"its backward is not deterministic on {meta.device.type!r}")
        return reasons + list(self.limits(meta))


@dataclass(frozen=True)
class LazyBackend:
    """An entry point's stand-in for a backend whose module is costly to import: ``target`` ("module:attribute")
    names the Backend, loaded when first needed. ``auto_devices`` and ``priority`` must be the Backend's own."""

    name: str
    target: str
    auto_devices: frozenset
    priority: int = 0

    def load(self) -> Backend:
        module, _, attribute = self.target.partition(":")
        return getattr(importlib.import_module(module), attribute)


class BackendUnavailableError(RuntimeError):
    """No backend can run the call; the message lists every known backend and why it was not used."""


class Request(NamedTuple):
    """The backend a call asks for, and where that came from (named in errors)."""

    name: str
    origin: str


_backends: dict = {}
_lazy: dict = {}  # name -> LazyBackend not imported yet
_load_errors: dict = {}
_discovered = False
_lock = threading.RLock()  # discovery and changes; lookups of a filled registry take no lock


def _new_lock_in_child() -> None:
    """A forked child has only the thread that forked: a lock another thread held at the fork (during discovery or
    a lazy backend's import) would stay held in the child forever. The registry's state is consistent at any
    bytecode (a backend is in ``_lazy`` until it is in ``_backends``); a discovery cut short runs again."""
    global _lock
    _lock = threading.RLock()


if hasattr(os, "register_at_fork"):  # POSIX
    os.register_at_fork(after_in_child=_new_lock_in_child)
_scope: contextvars.ContextVar = contextvars.ContextVar("msda_use_backend", default=())  # _Scopes, innermost last
_resolved: dict = {}  # (request name, Metadata) -> Backend; emptied on any change of the registry


def register(backend: Backend | LazyBackend) -> None:
    """Add a backend under its name, or replace the one of that name, for this process.

    Installed packages register theirs through the ``msda.backends`` entry-point group, found on first use; call
    this for a backend defined at run time (a test, an experiment). Selection forgets what it memoised, so the
    next call sees the change.

    Args:
        backend: a :class:`Backend`, or a :class:`LazyBackend` naming where one is, imported when first needed.

    Example:
        >>> import torch, msda_core
        >>> def forward(inputs):                  # zeros: a backend that shows it ran
        ...     return inputs.value.new_zeros(msda_core.output_shape(inputs.value, inputs.sampling_locations))
        >>> def backward(grad_output, inputs, grad_accum, deterministic):
        ...     return tuple(torch.zeros_like(t) for t in (inputs.value, inputs.sampling_locations,
        ...                                                inputs.attention_weights))
        >>> msda_core.register(msda_core.Backend("zeros", forward, backward, devices=frozenset({"cpu"}),
        ...                                      dtypes=frozenset({torch.float32})))
        >>> value, locations = torch.ones(1, 30, 2, 8), torch.rand(1, 5, 2, 2, 3, 2)
        >>> out = msda_core.deform_attn(value, torch.tensor([(4, 6), (2, 3)]), None, locations,
        ...                             torch.rand(1, 5, 2, 2, 3), backend="zeros")
        >>> out.abs().sum().item()
        0.0
        >>> msda_core.unregister("zeros")
        >>> "zeros" in msda_core.backends()
        False
    """
    with _lock:
        _discover()
        _add(backend)
        _resolved.clear()


def unregister(name: str) -> None:
    """Remove the backend registered as ``name`` for this process (nothing if there is none); selection forgets
    what it memoised. A later call that names it raises :class:`BackendUnavailableError`.

    Args:
        name: the backend's name, as in ``msda_core.backends()``.

    Example: see :func:`register`.
    """
    with _lock:
        _discover()
        _backends.pop(name, None)
        _lazy.pop(name, None)
        _resolved.clear()


def _add(backend: Backend | LazyBackend) -> None:
    _backends.pop(backend.name, None)
    _lazy.pop(backend.name, None)
    _load_errors.pop(backend.name, None)
    (_lazy if isinstance(backend, LazyBackend) else _backends)[backend.name] = backend


def _load(name: str) -> None:
    """Import a lazy backend: into the registry, or its error into load_errors."""
    with _lock:
        lazy = _lazy.get(name)
        if lazy is None:  # another thread loaded it
            return
        try:
            _backends[name] = lazy.load()
        except Exception as err:  # as a broken entry point: skipped by auto, raised when asked for by name
            _load_errors[name] = err
        del _lazy[name]  # only now: a child forked during the import still has it to load
        _resolved.clear()


def get(name: str) -> Backend:
    """The backend registered as ``name``, imported if it was lazy; KeyError if there is none."""
    _discover()
    if name in _lazy:
        _load(name)
    return _backends[name]


def _discover() -> None:
    """Load the entry points once. The flag is set only when every backend is in: a thread that arrives while
    another is loading waits for it rather than seeing a half-filled registry."""
    global _discovered
    if _discovered:
        return
    with _lock:
        if _discovered:
            return
        for ep in entry_points(group=ENTRY_POINT_GROUP):
            try:
                backend = ep.load()
            except Exception as err:  # a broken backend must not break the others; shown when asked by name
                _load_errors[ep.name] = err
                continue
            _add(backend)
        _discovered = True


def backends() -> dict:
    """Every backend that loaded, by name; lazy ones are imported (so on a CPU machine with msda-triton this
    imports Triton). Backends whose import failed are left out: :func:`load_errors` has them.

    Returns:
        A new dict, name -> :class:`Backend` (its ``devices``, ``dtypes``, ``priority`` and flags say what it
        supports).

    Example:
        >>> import torch, msda_core
        >>> gather = msda_core.backends()["gather"]    # msda-reference's CPU backend
        >>> sorted(gather.devices), torch.bfloat16 in gather.dtypes
        (['cpu'], True)
    """
    _discover()
    for name in list(_lazy):
        _load(name)
    return dict(_backends)


def names() -> list:
    """Every backend name a call may ask for, "auto" first; imports nothing."""
    _discover()
    return ["auto", *sorted(set(_backends) | set(_lazy) | set(_load_errors))]


def check_name(name, arg: str = "backend") -> None:
    """Raise where a backend is named (use_backend, patch, a module's constructor), not at a later call."""
    if isinstance(name, str) and name in names():
        return
    hint = f" ({name} is provided by {FIRST_PARTY[name]}, which is not installed)" if name in FIRST_PARTY else ""
    raise ValueError(f"{arg}: expected 'auto' or one of {names()[1:]}, got {name!r}{hint}")


def load_errors() -> dict:
    """Name -> exception for every backend whose entry point failed to import."""
    _discover()
    return dict(_load_errors)


class _Scope:
    """One use_backend block: its name, and whether it is still open (closed from any thread)."""

    __slots__ = ("name", "open")

    def __init__(self, name: str):
        self.name, self.open = name, True


@contextlib.contextmanager
def use_backend(name: str):
    """Within the block, calls that pass ``backend="auto"`` (the default) ask for ``name`` instead.

    The innermost block wins; a call's own ``backend=`` wins over any block, and a block over the
    ``MSDA_BACKEND`` environment variable. The scope belongs to the calling thread (or asyncio task): other
    threads keep their own. A block exited from another thread ends for the thread that entered it too. The name
    is checked on entry; whether the backend can run a call is decided at the call.

    Args:
        name: ``"auto"`` or a backend's name (``msda_core.backends()``), e.g. ``"grid_sample"``.

    Raises:
        ValueError: ``name`` is neither ``"auto"`` nor a known backend (the message lists those installed).

    Example:
        >>> import torch, msda_core
        >>> value, locations = torch.zeros(1, 30, 2, 8), torch.zeros(1, 5, 2, 2, 3, 2)
        >>> with msda_core.use_backend("grid_sample"):
        ...     msda_core.resolve_backend(value, locations)
        'grid_sample'
        >>> msda_core.resolve_backend(value, locations)
        'gather'
        >>> with msda_core.use_backend("nope"):  # doctest: +ELLIPSIS
        ...     pass
        Traceback (most recent call last):
        ValueError: name: expected 'auto' or one of [...], got 'nope'
    """
    check_name(name, "name")
    scope = _Scope(name)
    _scope.set(_scope.get() + (scope,))
    try:
        yield
    finally:
        scope.open = False
        _scope.set(tuple(s for s in _scope.get() if s.open))


def request(backend: str = "auto") -> Request:
    """What a call asks for, after the scope and the environment variable are applied, and from where."""
    if backend != "auto":
        return Request(backend, "the backend= argument")
    for scope in reversed(_scope.get()):
        if scope.open:
            return Request(scope.name, "a use_backend() scope")
    from_env = os.environ.get(ENV_VAR, "auto") or "auto"
    return Request(from_env, f"the {ENV_VAR} environment variable") if from_env != "auto" else Request("auto", "")


def _candidates_report(rows: list) -> str:
    return "\n".join(f"  {name}: {reason}" for name, reason in rows)


def resolve(wanted: Request | str, meta: Metadata) -> Backend:
    """The backend that runs inputs of ``meta`` for ``wanted`` (a Request, a name or "auto"), or
    BackendUnavailableError."""
    if isinstance(wanted, str):
        wanted = request(wanted)
    key = (wanted.name, meta)
    try:
        chosen = _resolved.get(key)
    except TypeError:  # symbolic sizes (tracing with dynamic shapes) are unhashable: select without the memo
        return _select(wanted, meta)
    if chosen is None:
        chosen = _select(wanted, meta)
        with _lock:
            # shapes vary with image size: bound the memo, don't grow forever (a new Q on every call: RSS rises by
            # up to 6 MB while it fills, then levels off, over 16,000 CPU calls)
            if len(_resolved) >= 4096:
                _resolved.clear()
            _resolved[key] = chosen
    return chosen


def _select(wanted: Request, meta: Metadata) -> Backend:
    _discover()
    rows = []
    if wanted.name == "auto":
        for lazy in list(_lazy.values()):
            if meta.device.type in lazy.auto_devices:
                _load(lazy.name)
        rows += [(lazy.name, f"auto does not choose it on {meta.device.type!r} (ask for it by name)")
                 for lazy in _lazy.values()]
        ranked = sorted(_backends.values(), key=lambda b: -b.priority)
        for b in ranked:
            reasons = b.not_supported_reasons(meta)
            if not reasons and meta.device.type not in b.auto_devices:
                reasons = [f"auto does not choose it on {meta.device.type!r} (ask for it by name)"]
            if not reasons:
                return b
            rows.append((b.name, "; ".join(reasons)))
        rows += _error_rows()
        raise BackendUnavailableError(
            f"backend: no backend supports these inputs ({_describe(meta)}); candidates:\n"
            + (_candidates_report(rows) or "  (none installed: install msda-reference)")
        )
    origin = f" (asked for by {wanted.origin})"
    if wanted.name in _lazy:
        _load(wanted.name)
    if wanted.name in _backends:
        b = _backends[wanted.name]
        reasons = b.not_supported_reasons(meta)
        if not reasons:
            return b
        others = [(n, "; ".join(o.not_supported_reasons(meta)) or "supports these inputs")
                  for n, o in _backends.items() if n != wanted.name] + [(n, "not imported") for n in _lazy]
        raise BackendUnavailableError(
            f"backend: {wanted.name!r}{origin} cannot run these inputs ({_describe(meta)}): {'; '.join(reasons)}\n"
            f"other backends:\n{_candidates_report(others + _error_rows())}"
        )
    if wanted.name in _load_errors:
        raise BackendUnavailableError(
            f"backend: {wanted.name!r}{origin} failed to import: {_load_errors[wanted.name]!r}"
        ) from _load_errors[wanted.name]
    if wanted.name in FIRST_PARTY:
        package = FIRST_PARTY[wanted.name]
        raise BackendUnavailableError(
            f"backend: {wanted.name!r}{origin} is provided by the package {package}, which is not installed "
            f"(pip install ./packages/{package})")
    known = [(n, "; ".join(b.not_supported_reasons(meta)) or "supports these inputs") for n, b in _backends.items()]
    known += [(n, "not imported") for n in _lazy]
    raise BackendUnavailableError(
        f"backend: expected 'auto' or one of {names()[1:]}, got {wanted.name!r}"
        f"{origin}\nknown backends:\n{_candidates_report(known + _error_rows())}"
    )


def _error_rows() -> list:
    return [(name, f"failed to import: {err!r}") for name, err in _load_errors.items()]


def _describe(meta: Metadata) -> str:
    return (
        f"device={meta.device}, value dtype={meta.value_dtype}, location dtype={meta.location_dtype}, "
        f"B={meta.batch}, Q={meta.queries}, M={meta.heads}, D={meta.head_dim}, "
        f"L={meta.levels}, P={meta.points}, grad_accum={meta.grad_accum!r}, deterministic={meta.deterministic}"
    )

"""The backend registry: what each backend can take, and which one a call runs.

Backends live in other packages and are found through the entry-point group ``msda.backends``, so this
package never imports them by name. Each entry point names a :class:`Backend` object.

Which backend a call asks for, first match wins: the op's ``backend=`` argument when it is not
``"auto"``, the innermost :func:`use_backend` scope, the ``MSDA_BACKEND`` environment variable, else
``"auto"``. ``"auto"`` takes the highest-priority backend that supports the inputs and lists the current
device type in its ``auto_devices``.
"""

from __future__ import annotations

import contextlib
import os
from dataclasses import dataclass, field
from importlib.metadata import entry_points
from typing import Callable, NamedTuple

import torch

ENTRY_POINT_GROUP = "msda.backends"
ENV_VAR = "MSDA_BACKEND"


class Inputs(NamedTuple):
    """What selection may look at: metadata only, never tensor values (selection runs while tracing). A named
    tuple, as it is made and hashed on every call: a frozen dataclass took twice the host time."""

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
           deterministic: bool = False) -> "Inputs":
        B, Q, M, L, P, _ = sampling_locations.shape
        return cls(value.device, value.dtype, sampling_locations.dtype, B, Q, M, value.shape[3], L, P, grad_accum,
                   deterministic)


@dataclass(frozen=True)
class Backend:
    """A named implementation of the op's forward and backward, with what it supports."""

    name: str
    forward: Callable  # (value, spatial_shapes, level_start_index, sampling_locations, attention_weights) -> out
    backward: Callable  # (grad_output, value, ..., attention_weights, grad_accum, deterministic) -> 3 gradients
    devices: frozenset  # device types it runs on
    dtypes: frozenset  # dtypes of value it accepts
    auto_devices: frozenset = frozenset()  # device types on which "auto" may choose it
    priority: int = 0  # "auto" prefers higher
    deterministic_on: frozenset = frozenset()  # device types where its backward replays bit for bit
    accumulation_switch: bool = False  # honors grad_accum (it scatters grad_value with atomic adds)
    deterministic_mode: bool = False  # makes its backward bitwise reproducible on any device when asked
    limits: Callable[[Inputs], list] = field(default=lambda inputs: [])  # further reasons it can't run

    def not_supported_reasons(self, inputs: Inputs) -> list:
        reasons = []
        if inputs.device.type not in self.devices:
            reasons.append(f"device type {inputs.device.type!r} not in {sorted(self.devices)}")
        if inputs.value_dtype not in self.dtypes:
            reasons.append(f"dtype {inputs.value_dtype} not supported")
        if inputs.deterministic and inputs.device.type not in self.deterministic_on and not self.deterministic_mode:
            reasons.append(f"its backward is not deterministic on {inputs.device.type!r}")
        return reasons + list(self.limits(inputs))


class BackendUnavailableError(RuntimeError):
    """No backend can run the call; the message lists every known backend and why it was not used."""


_backends: dict = {}
_load_errors: dict = {}
_discovered = False
_scopes: list = []  # stack of names set by use_backend
_resolved: dict = {}  # (request, Inputs) -> Backend: selection runs twice per training step; emptied on any change


def register(backend: Backend) -> None:
    """Add or replace a backend (entry points call this implicitly; tests and users may call it)."""
    _discover()
    _backends[backend.name] = backend
    _load_errors.pop(backend.name, None)
    _resolved.clear()


def unregister(name: str) -> None:
    _discover()
    _backends.pop(name, None)
    _resolved.clear()


def _discover() -> None:
    global _discovered
    if _discovered:
        return
    _discovered = True
    for ep in entry_points(group=ENTRY_POINT_GROUP):
        try:
            backend = ep.load()
        except Exception as err:  # a broken backend must not break the others; shown when asked by name
            _load_errors[ep.name] = err
            continue
        _backends[backend.name] = backend


def backends() -> dict:
    """Name -> Backend for every backend that loaded."""
    _discover()
    return dict(_backends)


def load_errors() -> dict:
    """Name -> exception for every backend whose entry point failed to import."""
    _discover()
    return dict(_load_errors)


@contextlib.contextmanager
def use_backend(name: str):
    """Within the block, calls that pass backend="auto" ask for ``name`` instead."""
    _scopes.append(name)
    try:
        yield
    finally:
        _scopes.pop()


def requested(backend: str = "auto") -> str:
    """The backend name a call asks for, after the scope and the environment variable are applied."""
    if backend != "auto":
        return backend
    if _scopes:
        return _scopes[-1]
    return os.environ.get(ENV_VAR, "auto") or "auto"


def _candidates_report(rows: list) -> str:
    return "\n".join(f"  {name}: {reason}" for name, reason in rows)


def resolve(request: str, inputs: Inputs) -> Backend:
    """The backend that runs ``inputs`` for ``request`` (a name or "auto"), or BackendUnavailableError."""
    key = (request, inputs)
    if key not in _resolved:
        if len(_resolved) >= 4096:  # shapes vary with image size: bound the memo, don't grow forever
            _resolved.clear()
        _resolved[key] = _select(request, inputs)
    return _resolved[key]


def _select(request: str, inputs: Inputs) -> Backend:
    _discover()
    rows = []
    if request == "auto":
        ranked = sorted(_backends.values(), key=lambda b: -b.priority)
        for b in ranked:
            reasons = b.not_supported_reasons(inputs)
            if not reasons and inputs.device.type not in b.auto_devices:
                reasons = [f"auto does not choose it on {inputs.device.type!r} (ask for it by name)"]
            if not reasons:
                return b
            rows.append((b.name, "; ".join(reasons)))
        rows += _error_rows()
        raise BackendUnavailableError(
            f"backend: no backend supports these inputs ({_describe(inputs)}); candidates:\n"
            + (_candidates_report(rows) or "  (none installed: install msda-reference)")
        )
    if request in _backends:
        b = _backends[request]
        reasons = b.not_supported_reasons(inputs)
        if not reasons:
            return b
        others = [(n, "; ".join(o.not_supported_reasons(inputs)) or "supports these inputs")
                  for n, o in _backends.items() if n != request]
        raise BackendUnavailableError(
            f"backend: {request!r} cannot run these inputs ({_describe(inputs)}): {'; '.join(reasons)}\n"
            f"other backends:\n{_candidates_report(others + _error_rows())}"
        )
    if request in _load_errors:
        raise BackendUnavailableError(
            f"backend: {request!r} failed to import: {_load_errors[request]!r}"
        ) from _load_errors[request]
    known = [(n, "; ".join(b.not_supported_reasons(inputs)) or "supports these inputs") for n, b in _backends.items()]
    raise BackendUnavailableError(
        f"backend: expected 'auto' or one of {sorted(set(_backends) | set(_load_errors))}, got {request!r}\n"
        f"known backends:\n{_candidates_report(known + _error_rows())}"
    )


def _error_rows() -> list:
    return [(name, f"failed to import: {err!r}") for name, err in _load_errors.items()]


def _describe(inputs: Inputs) -> str:
    return (
        f"device={inputs.device}, value dtype={inputs.value_dtype}, location dtype={inputs.location_dtype}, "
        f"B={inputs.batch}, Q={inputs.queries}, M={inputs.heads}, D={inputs.head_dim}, "
        f"L={inputs.levels}, P={inputs.points}, grad_accum={inputs.grad_accum!r}, deterministic={inputs.deterministic}"
    )

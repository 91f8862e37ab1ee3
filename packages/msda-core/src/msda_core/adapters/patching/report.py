"""What ``patch`` did: one ``Patched`` entry per module it routed through msda (with each of its sites' calls and
verification), one ``LeftAlone`` per module it recognised and did not, and the ``PatchReport`` holding them."""

from __future__ import annotations

import weakref
from dataclasses import dataclass, field
from typing import Any

from torch import nn

from . import replace

# Printed under every report that patched something: where a user comparing gradients before and after is told why
# they may differ at a library's own initialisation.
KNOTS = ("gradients of sampling_offsets may differ from the original's where samples sit exactly on pixel knots "
         "(some libraries' initialisation), while outputs agree: README.md, \"Knots\"")
NOT_COUNTED = "calls inside torch.compile'd code are neither counted nor verified"


@dataclass(frozen=True)
class Patched:
    """A module whose multi-scale deformable attention now runs msda, and how: one site per function it calls
    (transformers' child and the attributes: one; a forward calling two known names, as mmcv's does: two)."""

    name: str  # the module's qualified name in the model ("" is the model itself)
    cls: str  # module path and class of the module msda now serves
    sites: tuple = field(repr=False, compare=False)
    replacement: Any = field(default=None, repr=False, compare=False)  # what patch put in the model; None: a global

    @property
    def mechanism(self) -> str:
        return ", ".join(site.label for site in self.sites)

    @property
    def calls(self) -> int:
        """This module's eager calls that msda served."""
        return sum(site.calls for site in self.sites)

    @property
    def fallbacks(self) -> int:
        """This module's calls whose arguments msda cannot serve, passed to the original."""
        return sum(site.fallbacks for site in self.sites)

    @property
    def verification(self) -> list:
        """Per site: verified (with the measured difference), not verified (why) or not yet called."""
        return [site.state for site in self.sites]

    @property
    def reverted(self) -> str | None:
        """Why every site of this module runs its original again (verification found other numbers), or None."""
        reasons = [site.reverted for site in self.sites]
        return None if None in reasons else "; ".join(f"{s.label}: {r}" for s, r in zip(self.sites, reasons))

    def __str__(self) -> str:
        lines = []
        for site in self.sites:
            fallback = f" ({site.fallback_reason})" if site.fallbacks else ""
            state = f"left alone since: {site.reverted}" if site.reverted else site.state
            lines.append(f"patched {self.name or '<model>'} ({self.cls}): {site.label}: {site.calls} calls through "
                         f"msda, {site.fallbacks} to the original{fallback}; {state}")
        return "\n  ".join(lines)


@dataclass(frozen=True)
class LeftAlone:
    """A module that looks like multi-scale deformable attention but was not patched (or was reverted), and why."""

    name: str
    cls: str
    reason: str

    def __str__(self) -> str:
        return f"left alone {self.name or '<model>'} ({self.cls}): {self.reason}"


class PatchReport:
    """What ``patch`` did: ``patched`` and ``left_alone`` entries (a patched module whose original computed other
    numbers on its first call moves to ``left_alone``), ``calls`` made through msda since. Printable. As a context
    manager, ``with msda_core.patch(model):`` unpatches the model on exit."""

    def __init__(self, model: nn.Module, backend: str, verify: bool):
        self._model, self._model_name = weakref.ref(model), type(model).__name__
        self.backend, self.verify = backend, verify
        self._patched: list = []
        self._left_alone: list = []
        self._undo: list = []  # (weakref to a module, attribute name, original value): children and attributes
        self._globals: list = []  # (GlobalName, Site) acquired, released once: by unpatch or with the model
        self._release = weakref.finalize(model, _forget, id(model), self._globals)
        self._release.atexit = False

    @property
    def model(self) -> nn.Module | None:
        """The patched model (None once it has been collected)."""
        return self._model()

    @property
    def patched(self) -> list:
        return [p for p in self._patched if not p.reverted]

    @property
    def left_alone(self) -> list:
        return self._left_alone + [LeftAlone(p.name, p.cls, p.reverted) for p in self._patched if p.reverted]

    @property
    def calls(self) -> int:
        """The model's eager calls that msda served (each module's own, whichever names it shares)."""
        return sum(p.calls for p in self._patched)

    def __str__(self) -> str:
        patched, left_alone = self.patched, self.left_alone
        lines = [f"msda_core.patch({self._model_name}, backend={self.backend!r}, verify={self.verify}): "
                 f"{len(patched)} patched, {len(left_alone)} left alone"]
        lines += [f"  {p}" for p in patched] + [f"  {e}" for e in left_alone]
        if patched:
            lines += [f"  note: {NOT_COUNTED}", f"  note: {KNOTS}"]
        return "\n".join(lines)

    def __enter__(self) -> PatchReport:
        return self

    def __exit__(self, *exc) -> None:
        model = self.model
        with replace.lock():
            if model is not None and report_of(model) is self:  # not when unpatched inside the block already
                del _reports[id(model)]
                self._restore()

    def _restore(self) -> None:
        for module, attribute, original in reversed(self._undo):
            if module() is not None:
                setattr(module(), attribute, original)
        self._undo.clear()
        self._release()


# Patched model -> its report, by id: nothing is stored on the model (it still pickles and deep-copies), and a
# model need not be hashable to be looked up. The report holds the model weakly; a model collected while patched
# leaves the table and releases its globals.
_reports: dict = {}


def report_of(model: nn.Module) -> PatchReport | None:
    report = _reports.get(id(model))
    return report if report is not None and report.model is model else None


def _forget(key: int, acquired: list) -> None:
    with replace.lock():
        report = _reports.get(key)
        if report is not None and report.model is None:
            del _reports[key]
    replace.release(acquired)

"""Resident forms: how a loaded state is held for the batch (``kite serve --resident``,
``server.resident``), one registered class each.

A :class:`ResidentForm` says
- its ``name`` (what the flag and the config key take) and the settings it takes (``options``);
- how a load becomes what a batch row holds: :meth:`ResidentForm.load`, ``load_prefix``'s arguments
  in, a kite.runtime.resident.ResidentPrefix of its ``prefix_type`` and the LoadReport out (the
  report's ``resident`` is the form's name, its ``resident_bytes`` what the prefix holds);
- the bytes that holds: :meth:`ResidentForm.nbytes`;
- how the batch attends to it: its ``prefix_type`` (in the row's slots, or ``beside`` them through
  the type's ``attend``).

:data:`RESIDENT_FORMS` is the registry (name -> class) that validation, the server's prefix cache
and the tests read; :func:`resident_form` builds one by name. ``raw``: the load's KV rebuilt, in the
row's slots. ``lanes``: the rebuilt KV coded again into nibble lanes (kite.upcycle.codec.lanes),
attended from their codes.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from typing import ClassVar

from kite.errors import BadInput
from kite.runtime.cache import KVPrefix
from kite.runtime.resident import LanesPrefix, ResidentPrefix

RESIDENT_FORMS: dict[str, type[ResidentForm]] = {}


class ResidentForm(ABC):
    """One way to hold a loaded state for the batch (see the module docstring)."""

    name: ClassVar[str]
    prefix_type: ClassVar[type[ResidentPrefix]]
    options: ClassVar[tuple[str, ...]] = ()     # settings it takes (resident_form passes these)

    @abstractmethod
    def load(self, state, lm, **kwargs):
        """``load_prefix(state, lm, **kwargs)`` held in this form: (prefix, LoadReport). BadInput for
        a load the form cannot hold (the caller may then hold it raw)."""

    def nbytes(self, prefix: ResidentPrefix) -> int:
        """Bytes ``prefix`` (one of this form's) holds on its device."""
        return prefix.nbytes()


def register(cls: type[ResidentForm]) -> type[ResidentForm]:
    """Add a form to RESIDENT_FORMS under its name (a class decorator)."""
    if cls.name in RESIDENT_FORMS:
        raise ValueError(f"a resident form named {cls.name!r} is registered already")
    RESIDENT_FORMS[cls.name] = cls
    return cls


def check_resident(name: str) -> str:
    """``name`` if it is a registered form, else BadInput naming the ones there are."""
    if name not in RESIDENT_FORMS:
        raise BadInput(f"server.resident {name!r}: expected one of {', '.join(RESIDENT_FORMS)}")
    return name


def resident_form(name: str, **settings) -> ResidentForm:
    """The form registered as ``name``, built with the ``settings`` it takes (its ``options``; the
    others are ignored). BadInput for an unknown name or a bad setting."""
    cls = RESIDENT_FORMS[check_resident(name)]
    return cls(**{k: v for k, v in settings.items() if k in cls.options})


@register
class RawResident(ResidentForm):
    """The load's KV rebuilt (``load_prefix``), copied into the row's slots."""

    name = "raw"
    prefix_type = KVPrefix

    def load(self, state, lm, **kwargs):
        from kite.upcycle.load.prefix import load_prefix

        return load_prefix(state, lm, **kwargs)


@register
class LanesResident(ResidentForm):
    """The load's KV rebuilt, then coded into nibble lanes of ``lane_bits`` bits an element ("B" or
    "K:V": keys, values; kite.upcycle.load.lanes.load_lanes) on the model's device, attended from them."""

    name = "lanes"
    prefix_type = LanesPrefix
    options = ("lane_bits",)

    def __init__(self, lane_bits: str = "4"):
        from kite.config import parse_lane_bits

        self.lane_bits = parse_lane_bits(lane_bits)

    def load(self, state, lm, **kwargs):
        from kite.upcycle.load.lanes import load_lanes

        return load_lanes(state, lm, lane_bits=self.lane_bits, **kwargs)

"""Incremental branch-structure detectors (pure; no SGLang import)."""

from __future__ import annotations

from collections.abc import Mapping
from types import MappingProxyType
from typing import Any

from branchwise.fork.grammars.base import (
    BranchClosed,
    Detector,
    Event,
    GrammarError,
    Mode,
    Node,
    PhaseClosed,
    PhaseOpened,
    fill_text,
)
from branchwise.fork.grammars.multiverse import MultiverseDetector, MultiverseTags
from branchwise.fork.grammars.sprint import SprintDetector, SprintTags

DETECTORS: Mapping[str, type[Detector]] = MappingProxyType({"multiverse": MultiverseDetector,
                                                            "sprint": SprintDetector})


def get_detector(name: str, **kw: Any) -> Detector:
    """Build a detector by grammar name; kwargs go to its constructor (mode, tags, limits)."""
    try:
        cls = DETECTORS[name.lower()]
    except KeyError:
        raise ValueError(f"unknown grammar {name!r}; valid: {', '.join(sorted(DETECTORS))}") from None
    return cls(**kw)


def parse(name: str, text: str, **kw: Any) -> Node:
    """Whole-text parse of a complete serial output (observe mode)."""
    det = get_detector(name, mode=Mode.OBSERVE, **kw)
    det.feed(text)
    det.finish()
    return fill_text(det.root, text)


__all__ = [
    "DETECTORS",
    "BranchClosed",
    "Detector",
    "Event",
    "GrammarError",
    "Mode",
    "MultiverseDetector",
    "MultiverseTags",
    "Node",
    "PhaseClosed",
    "PhaseOpened",
    "SprintDetector",
    "SprintTags",
    "get_detector",
    "parse",
]

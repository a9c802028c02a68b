from __future__ import annotations
from dataclasses import dataclass, field

CATEGORIES = ("params", "grads", "optimizer", "activations", "temporaries")

@dataclass
class MemoryEstimate:
    method: str
    batch_size: int
    breakdown: dict
    peak_bytes: int
    notes: list = field(default_factory=list)

    @classmethod
    def from_categories(cls, method, batch_size, *, total=None, notes=(), **parts):
        peak = int(total) if total is not None else int(sum(parts.values()))
        return cls(method, batch_size, {k: int(parts.get(k, 0)) for k in CATEGORIES}, peak, list(notes))

"""What a layer kind is, and the registry that looks kinds up by name."""

from __future__ import annotations

import dataclasses
from typing import ClassVar

from kvjax.cache import layer_slots

INT32 = 4
KINDS: dict[str, Kind] = {}


def register(cls: type[Kind]) -> type[Kind]:
    """Class decorator: make the kind available to layer plans as `cls.name`."""
    if cls.name in KINDS:
        raise ValueError(f"a layer kind named {cls.name!r} is registered already")
    KINDS[cls.name] = cls()
    return cls


@dataclasses.dataclass(frozen=True)
class LayerMemory:
    """Bytes one producer layer's cache takes for one sequence."""

    kv_bytes_per_slot: int  # K and V payload
    meta_bytes_per_slot: int  # the slot's position
    bytes_per_sequence: int  # fixed bookkeeping (the length counter) and recurrent states
    max_slots: int | None  # the sliding window, or None when the cache grows without bound

    def bytes(self, tokens: int) -> int:
        slots = layer_slots(self.max_slots, tokens)
        return slots * (self.kv_bytes_per_slot + self.meta_bytes_per_slot) + self.bytes_per_sequence


class Kind:
    """A layer kind: its cache, the bytes that cache takes, and what other parts may do with it. The
    mixer module itself is registered under the same name in `kvjax.architectures.mixers`."""

    name: ClassVar[str]
    in_pattern: ClassVar[bool] = True  # `model.layer_pattern` may name it (else only YOCO places it)
    shares_kv: ClassVar[bool] = False  # its K/V cache may serve later layers (CLA, MLKV, YOCO)
    caches_tokens: ClassVar[bool] = False  # it caches something per token (K/V or a latent)
    recurrent: ClassVar[bool] = False  # its cache is a constant-size state (the engine keeps one per sequence)
    # Its own options: the `model.<section>` of a model config, a frozen dataclass `Config` that checks
    # itself. A model config holds the section only while one of its layers is of this kind.
    section: ClassVar[str | None] = None
    Config: ClassVar[type | None] = None

    def init_cache(self, cfg, batch: int, capacity: int, fresh: bool):
        """An empty cache of one producer layer for `batch` rows and `capacity` tokens."""
        raise NotImplementedError(f"layer kind {self.name!r} has no cache")

    def memory(self, cfg) -> LayerMemory:
        """The analytic bytes of that cache (tests hold them equal to the cache's `nbytes()`)."""
        raise NotImplementedError(f"layer kind {self.name!r} has no memory formula")

    def compressible(self, cfg) -> bool:
        """Whether a token-level policy compresses this layer's cache (it grows with the sequence)."""
        return False

    def window(self, cfg) -> int | None:
        """The sliding window of a layer whose cache is a ring of that many tokens (a policy compresses it
        only with `local=true`), else None."""
        return None

    def kv_heads(self, cfg) -> int:
        """KV heads of its cache, for a compressible kind (1 when one entry serves every head)."""
        raise NotImplementedError(f"layer kind {self.name!r} caches no K/V heads")

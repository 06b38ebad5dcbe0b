"""Typed per-kind caches of a Qwen4-Exp model (see `model_cache.ModelCache`, which builds them)."""

from tierlm.model.cache.host_checkpoints import HostCheckpoints, checkpoint_bytes
from tierlm.model.cache.qsa import QSADeviceKV, QSAIndexerState
from tierlm.model.cache.slot_state import GDNState, NgramContextState, PLEState, SlotState

__all__ = [
    "GDNState", "HostCheckpoints", "NgramContextState", "PLEState", "QSADeviceKV", "QSAIndexerState", "SlotState",
    "checkpoint_bytes",
]

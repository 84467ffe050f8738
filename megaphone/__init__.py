"""Megaphone: migratable stateful operators with live, latency-conscious state migration.

Keyed state lives in 2^k bins; a timestamped control stream says which worker owns which bin from
which time on; the routing operator F and the state operator S move bins between workers while the
dataflow runs (Hoffmann et al., "Megaphone", PVLDB 12(9), 2019). See DESIGN.md section 5.
"""
from timely.routing import bins_of, hash64

from .control import ControlError, ControlInput, apply_updates, check_update, default_table
from .controller import ControlEndpoint, Controller, RequestError, StepEvent
from .operators import BinNotificator, MegaphoneError, Migratable, binary, state_machine, unary
from .plan import STRATEGIES, balanced, check_table, moved_bins, plan, skewed

__all__ = [
    "STRATEGIES", "BinNotificator", "ControlEndpoint", "ControlError", "ControlInput", "Controller",
    "MegaphoneError", "Migratable", "RequestError", "StepEvent", "apply_updates", "balanced", "binary", "bins_of", "hash64",
    "check_table", "check_update", "default_table", "moved_bins", "plan", "skewed", "state_machine", "unary",
]

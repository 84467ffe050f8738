"""Megaphone: migratable stateful operators with live, latency-conscious state migration.

Keyed state lives in 2^k bins; a timestamped control stream says which worker owns which bin from
which time on; the routing operator F and the state operator S move bins between workers while the
dataflow runs (Hoffmann et al., "Megaphone", PVLDB 12(9), 2019). See DESIGN.md section 5.
"""
from .control import ControlError, ControlInput, apply_updates, check_update, default_table
from .operators import BinNotificator, Migratable, MegaphoneError, binary, state_machine, unary

__all__ = [
    "BinNotificator", "ControlError", "ControlInput", "MegaphoneError", "Migratable", "apply_updates",
    "binary", "check_update", "default_table", "state_machine", "unary",
]

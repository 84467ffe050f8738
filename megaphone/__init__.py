"""Megaphone: migratable stateful operators with live, latency-conscious state migration.

Keyed state lives in 2^k bins; a timestamped control stream says which worker owns which bin from
which time on; the routing operator F and the state operator S move bins between workers while the
dataflow runs (Hoffmann et al., "Megaphone", PVLDB 12(9), 2019). See ARCHITECTURE.md section 5.
"""
from timely.routing import bins_of, hash64

from .bins import MegaphoneError
from .control import ControlInput
from .controller import Controller, StepEvent
from .endpoint import ControlEndpoint, EndpointError, RequestError
from .operators import Migratable, binary, state_machine, unary
from .plan import STRATEGIES, plan
from .state import BinNotificator
from .table import TableError, balanced, moved_bins, skewed, validate_table, validate_update

__all__ = [
    "STRATEGIES", "BinNotificator", "ControlEndpoint", "ControlInput", "Controller",
    "EndpointError", "MegaphoneError", "Migratable", "RequestError", "StepEvent", "TableError", "balanced", "binary",
    "bins_of", "hash64", "moved_bins", "plan", "skewed", "state_machine", "unary", "validate_table",
    "validate_update",
]

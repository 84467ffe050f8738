"""Megaphone: migratable stateful operators with live, latency-conscious state migration.

Keyed state lives in 2^k bins; a timestamped control stream says which worker owns which bin from
which time on; the routing operator F and the state operator S move bins between workers while the
dataflow runs (Hoffmann et al., "Megaphone", PVLDB 12(9), 2019). See ARCHITECTURE.md section 5.

The columnar operator :func:`aggregate` (running aggregates over streams of ``pyarrow.RecordBatch``)
and :func:`bins_of_column` live in :mod:`megaphone.columns`, imported on first use (it imports
pyarrow, which the row operators do not need).
"""
from typing import Any

from timely.routing import bins_of, hash64

from .autobalance import AutoBalancer, BalancePolicy
from .bins import MegaphoneError
from .control import ControlInput
from .controller import Controller, StepEvent
from .endpoint import ControlEndpoint, EndpointError, RequestError
from .operators import Migratable, binary, state_machine, unary
from .plan import STRATEGIES, plan
from .state import BinNotificator
from .table import TableError, balanced, moved_bins, skewed, validate_table, validate_update

__all__ = [
    "STRATEGIES", "AutoBalancer", "BalancePolicy", "BinNotificator", "ControlEndpoint", "ControlInput", "Controller",
    "EndpointError", "MegaphoneError", "Migratable", "RequestError", "StepEvent", "TableError", "aggregate", "balanced",
    "binary", "bins_of", "bins_of_column", "hash64", "moved_bins", "plan", "skewed", "state_machine", "unary", "validate_table",
    "validate_update",
]


def __getattr__(name: str) -> Any:
    """``aggregate`` and ``bins_of_column``, from :mod:`megaphone.columns` on first use."""
    if name in ("aggregate", "bins_of_column"):
        from . import columns

        return getattr(columns, name)
    raise AttributeError(f"module 'megaphone' has no attribute {name!r}")

"""Progress tracking: timestamps, antichains, change batches and the reachability tracker.

Pure computation: no I/O, no data records. See ARCHITECTURE.md section 2 for the invariants.
"""
from .change_batch import ChangeBatch
from .frontier import Antichain, MutableAntichain
from .reachability import Builder, CycleError, Location, Source, Target, Tracker
from .timestamp import Summary, Time, less_equal, less_than, minimal, minimum, to_inner, to_outer

__all__ = [
    "Antichain", "Builder", "ChangeBatch", "CycleError", "Location", "MutableAntichain", "Source",
    "Summary", "Target", "Time", "Tracker", "less_equal", "less_than", "minimal", "minimum",
    "to_inner", "to_outer",
]

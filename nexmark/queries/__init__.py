"""NEXMark queries Q0-Q8, each on plain engine operators and on Megaphone's migratable operators.

Every builder takes the event :class:`Streams` (and, for the Megaphone variants, the control input)
plus :class:`~nexmark.model.Params`, and returns the query's output stream. ``QUERIES`` maps a
query name (``"q0"`` .. ``"q8"``) to its :class:`Query`.
"""
from __future__ import annotations

from collections.abc import Callable
from typing import Any, NamedTuple

import timely

from ..model import Params
from .auctions import closed_auctions, closed_auctions_flex, q4, q4_flex, q6, q6_flex
from .common import Streams
from .joins import q3, q3_flex, q8, q8_flex
from .stateless import q0, q0_flex, q1, q1_flex, q2, q2_flex
from .windows import q5, q5_flex, q7, q7_flex


class Query(NamedTuple):
    """A query's two builders and a one-line description."""

    name: str
    native: Callable[[Streams, Params], timely.Stream]
    flex: Callable[[Streams, Any, Params], timely.Stream]
    description: str

    def build(self, streams: Streams, params: Params, control: Any = None) -> timely.Stream:
        """The output stream: the Megaphone variant when ``control`` is given, else the native one
        (``params`` checked first: :meth:`~nexmark.model.Params.check`)."""
        params.check()
        if control is None:
            return self.native(streams, params)
        return self.flex(streams, control, params)


QUERIES: dict[str, Query] = {q.name: q for q in (
    Query("q0", q0, q0_flex, "pass-through"),
    Query("q1", q1, q1_flex, "currency conversion (map)"),
    Query("q2", q2, q2_flex, "selection (filter)"),
    Query("q3", q3, q3_flex, "local item suggestion (incremental join)"),
    Query("q4", q4, q4_flex, "average closing price per category"),
    Query("q5", q5, q5_flex, "hot items (sliding window)"),
    Query("q6", q6, q6_flex, "average selling price per seller (last 10)"),
    Query("q7", q7, q7_flex, "highest bid (tumbling window)"),
    Query("q8", q8, q8_flex, "monitor new users (windowed join)"),
)}

__all__ = ["QUERIES", "Query", "Streams", "closed_auctions", "closed_auctions_flex"]

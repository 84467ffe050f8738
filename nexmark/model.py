"""The NEXMark event model: record layouts, generator configuration, and the time base.

Records are plain tuples (msgpack-friendly, cheap to build and to exchange):

* Person  ``(id, name, email, credit_card, city, state, date_time)``
* Auction ``(id, item_name, description, initial_bid, reserve, date_time, expires, seller, category)``
* Bid     ``(auction, bidder, price, date_time)``

The three kinds travel on three separate streams (no tag, no demultiplexing operator).

Time base
---------
Event ``n`` (global event number, from 0) has the event time, in milliseconds::

    date_time(n) = (n * 1000 * time_dilation) // rate

``rate`` is the number of events per *wall-clock* second summed over all workers, and
``time_dilation`` (``d``) is how much faster event time runs than wall-clock time (the Megaphone
paper's trick to make 12 h windows fit a 20 minute run). Dataflow timestamps are integer epochs of
one wall-clock millisecond::

    epoch(n) = date_time(n) // d = (n * 1000) // rate       (the ms in which event n is scheduled)

so that the scheduled wall time of event ``n`` is ``n / rate`` seconds after the start. A record may
be stamped with an *earlier* epoch than its own (a driver that falls behind sends everything due
in one batch at its input's current epoch), never a later one. Operators therefore derive every
event-time decision from ``date_time``, and emit a result about "all events before event time
``x``" at epoch :func:`last_epoch` ``(x, d)``: the last epoch that can hold such an event.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import NamedTuple

# Field indices.
P_ID, P_NAME, P_EMAIL, P_CARD, P_CITY, P_STATE, P_TIME = range(7)
A_ID, A_ITEM, A_DESC, A_INITIAL, A_RESERVE, A_TIME, A_EXPIRES, A_SELLER, A_CATEGORY = range(9)
B_AUCTION, B_BIDDER, B_PRICE, B_TIME = range(4)

US_STATES = ("AZ", "CA", "ID", "OR", "WA", "WY")
US_CITIES = ("phoenix", "los angeles", "san francisco", "boise", "portland", "bend", "redmond", "seattle",
             "kent", "cheyenne")
FIRST_NAMES = ("peter", "paul", "luke", "john", "saul", "vicky", "kate", "julie", "sarah", "deiter", "walter")
LAST_NAMES = ("shultz", "abrams", "spencer", "white", "bartels", "walton", "smith", "jones", "noris")


@dataclass(frozen=True)
class Config:
    """Generator parameters (defaults: Megaphone's ``config.rs`` / Beam's ``NexmarkConfiguration``)."""

    rate: int = 1_000_000  # events per wall-clock second, all workers together
    time_dilation: int = 1  # event time runs this many times faster than wall-clock time
    seed: int = 0
    active_people: int = 1000
    in_flight_auctions: int = 100
    hot_seller_ratio: int = 4  # 1 - 1/4 of auctions are sold by the hot seller
    hot_auction_ratio: int = 2  # 1 - 1/2 of bids go to the hot auction
    hot_bidder_ratio: int = 4  # 1 - 1/4 of bids come from the hot bidder
    hot_ratio_2: int = 100  # hot ids are multiples of this
    num_categories: int = 5
    first_category_id: int = 10
    first_person_id: int = 1000
    first_auction_id: int = 1000
    person_id_lead: int = 10
    auction_id_lead: int = 10
    person_proportion: int = 1
    auction_proportion: int = 3
    bid_proportion: int = 46

    def __post_init__(self) -> None:
        if self.rate < 1:
            raise ValueError(f"rate must be at least 1 event/s, not {self.rate}")
        if self.time_dilation < 1:
            raise ValueError(f"time_dilation must be a positive integer, not {self.time_dilation}")
        # Divisors and moduli of the generator (a zero killed the native generator with SIGFPE).
        for name in ("active_people", "in_flight_auctions", "hot_seller_ratio", "hot_auction_ratio",
                     "hot_bidder_ratio", "hot_ratio_2", "num_categories", "person_proportion",
                     "auction_proportion"):
            if getattr(self, name) < 1:
                raise ValueError(f"Config.{name} must be at least 1, not {getattr(self, name)}")
        for name in ("bid_proportion", "first_category_id", "first_person_id", "first_auction_id",
                     "person_id_lead", "auction_id_lead"):
            if getattr(self, name) < 0:
                raise ValueError(f"Config.{name} must not be negative, not {getattr(self, name)}")

    @property
    def denominator(self) -> int:
        """Events per proportion cycle (50)."""
        return self.person_proportion + self.auction_proportion + self.bid_proportion

    # -- the time base ------------------------------------------------------------------------
    def date_time(self, n: int) -> int:
        """Event time (ms) of event ``n``."""
        return (n * 1000 * self.time_dilation) // self.rate

    def epoch(self, n: int) -> int:
        """The epoch (wall-clock ms) in which event ``n`` is scheduled."""
        return (n * 1000) // self.rate

    def first_event(self, epoch: int) -> int:
        """The first event number scheduled in ``epoch`` or later."""
        return -((-epoch * self.rate) // 1000)


def last_epoch(x: int, d: int) -> int:
    """The last epoch that can hold an event with ``date_time < x`` (for ``x >= 1``).

    A result about every event before event time ``x`` (a window ending at ``x``, an auction
    expiring at ``x``) is emitted at this epoch, once the epoch is complete.
    """
    return (x - 1) // d


class Params(NamedTuple):
    """Query parameters. Windows are in event-time milliseconds; ``d`` is the time dilation."""

    d: int = 1
    q5_window_ms: int = 60_000
    q5_slide_ms: int = 1_000
    q7_window_ms: int = 10_000
    q8_window_ms: int = 12 * 3600 * 1000
    q2_skip: int = 123
    q3_category: int = 10
    q3_states: tuple = ("OR", "ID", "CA")

    def check(self) -> Params:
        """Validate (windows positive, the Q5 window a multiple of its slide, Q2's skip at least
        1); return self."""
        if self.d < 1:
            raise ValueError(f"time dilation must be >= 1, not {self.d}")
        for name in ("q5_window_ms", "q5_slide_ms", "q7_window_ms", "q8_window_ms"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be positive")
        if self.q5_window_ms % self.q5_slide_ms:
            raise ValueError("q5_window_ms must be a multiple of q5_slide_ms")
        if self.q2_skip < 1:  # (Q2 keeps the auctions whose id is a multiple of it)
            raise ValueError(f"q2_skip must be at least 1, not {self.q2_skip}")
        return self

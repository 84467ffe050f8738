"""The NEXMark event generator: deterministic per seed and event number, split across workers.

Every random choice of event ``n`` comes from a counter-based hash of ``(seed, n)`` (splitmix64),
never from a sequential random stream. An event is therefore the same whichever worker generates
it and whatever range it is generated in, so a run on 1, 2 or 3 workers sees exactly the same
events, and a reference computation can regenerate them.

Event ``n`` is a person, an auction or a bid by ``n % 50`` (1 : 3 : 46). Ids, hot keys, prices and
expiry follow Megaphone's ``nexmark/src/event.rs`` (itself a port of Beam's generator):

* ids are dense, persons and auctions from 1000;
* an auction's seller is the hot person ``(last_person / 100) * 100`` with probability 3/4, else
  one of the ~1000 most recent persons (or up to 10 not yet created);
* a bid's auction is the hot auction ``(last_auction / 100) * 100`` with probability 1/2, else one
  of the 100 most recent auctions (or up to 10 not yet created); its bidder is the hot person + 1
  with probability 3/4, else a recent person;
* prices are ``round(10 ** (6 u) * 100)`` for uniform ``u`` (log-uniform, 100 .. 10^8 cents);
* an auction expires ``1 + U[0, 2 h)`` ms after it opens, ``h`` being the event time spanned by the
  next ``in_flight_auctions`` auctions (in whole ms), so about that many auctions are open at any
  time: Beam's formula, whose mean ``h + 0.5`` ms opens up to 30% more where ``h`` is a ms or two
  (100 in flight at 1 M events/s: 129 on average).

Worker ``i`` of ``p`` generates events ``n = i, i + p, ...`` (interleaved), as in Megaphone.

Two backends compute the same events: a C one (``native/nexmark_gen.pyx``, about 4x faster, used
when built) and numpy columns (ranges generated ahead in chunks and handed out in slices).
"""
from __future__ import annotations

from typing import NamedTuple

import numpy as np

from .model import FIRST_NAMES, LAST_NAMES, US_CITIES, US_STATES, Config

try:
    import nexmark.nexmark_gen as _native
except ImportError:  # not built: the numpy backend does the same
    _native = None

_GOLDEN = np.uint64(0x9E3779B97F4A7C15)
_C1 = np.uint64(0xBF58476D1CE4E5B9)
_C2 = np.uint64(0x94D049BB133111EB)
_POOL = 1024  # distinct emails, card numbers, item names and descriptions


class EventBatch(NamedTuple):
    """Events of one range, split by kind; each list holds plain tuples in event-number order."""

    persons: list
    auctions: list
    bids: list

    @property
    def total(self) -> int:
        """The number of events of all kinds."""
        return len(self.persons) + len(self.auctions) + len(self.bids)


def _mix(z: np.ndarray) -> np.ndarray:
    """The splitmix64 finaliser, elementwise on a uint64 array (wrapping arithmetic)."""
    z = z ^ (z >> np.uint64(30))
    z *= _C1
    z ^= z >> np.uint64(27)
    z *= _C2
    return z ^ (z >> np.uint64(31))


def _as_int64(seed: int) -> int:
    """``seed``'s low 64 bits as a signed 64-bit integer: the native backend's ``int64_t`` field
    takes any seed then, and uses the same bits (``seed & 0xFFFFFFFFFFFFFFFF``) as numpy's."""
    return ((seed & 0xFFFFFFFFFFFFFFFF) ^ (1 << 63)) - (1 << 63)


def _hashes(n: np.ndarray, seed: int, count: int) -> list[np.ndarray]:
    """``count`` independent 64-bit hashes of each event number (a pure function of seed and n)."""
    key = _mix(np.array([seed & 0xFFFFFFFFFFFFFFFF], dtype=np.uint64))[0]
    base = _mix(n.astype(np.uint64) * _GOLDEN ^ key)
    return [_mix(base + np.uint64(((j + 1) * 0x9E3779B97F4A7C15) & 0xFFFFFFFFFFFFFFFF)) for j in range(count)]


def _below(h: np.ndarray, k: np.ndarray | int) -> np.ndarray:
    """A draw in ``[0, k)`` from hash bits (k may be an array); int64."""
    return (h % np.asarray(k, dtype=np.uint64)).astype(np.int64)


def _uniform(h: np.ndarray) -> np.ndarray:
    """A float in ``[0, 1)`` from the top 53 bits of a hash."""
    return (h >> np.uint64(11)).astype(np.float64) * (1.0 / (1 << 53))


def _price(h: np.ndarray) -> np.ndarray:
    return np.rint(np.power(10.0, _uniform(h) * 6.0) * 100.0).astype(np.int64)


def _pool(prefix: str, size: int, rng: np.random.Generator, length: int) -> np.ndarray:
    letters = np.array(list("abcdefghijklmnopqrstuvwxyz"))
    words = ["".join(rng.choice(letters, length)) for _ in range(size)]
    return np.array([f"{prefix}{w}" for w in words], dtype=object)


class _Pools:
    """Fixed string pools (built once, from a fixed seed) that string fields are drawn from."""

    def __init__(self) -> None:
        rng = np.random.default_rng(20020101)
        self.names = np.array([f"{f} {last}" for f in FIRST_NAMES for last in LAST_NAMES], dtype=object)
        self.emails = np.array([f"{w}@{d}.com" for w, d in zip(_pool("", _POOL, rng, 7), _pool("", _POOL, rng, 5))],
                               dtype=object)
        self.cards = np.array([" ".join(f"{x:04d}" for x in rng.integers(0, 10000, 4)) for _ in range(_POOL)],
                              dtype=object)
        self.items = _pool("", _POOL, rng, 12)
        self.descriptions = _pool("item ", _POOL, rng, 40)
        self.cities = np.array(US_CITIES, dtype=object)
        self.states = np.array(US_STATES, dtype=object)


_pools: _Pools | None = None


def _get_pools() -> _Pools:
    global _pools
    if _pools is None:
        _pools = _Pools()
    return _pools


class Generator:
    """Generates the events of worker ``index`` of ``peers`` for ``config``.

    ``events(lo, hi)`` returns this worker's events with ``lo <= n < hi``; ``until(hi)`` continues
    from where the previous call stopped (a cursor for open-loop drivers). ``backend`` is
    ``"native"``, ``"numpy"`` or ``"auto"`` (native when built).
    """

    def __init__(self, config: Config, index: int = 0, peers: int = 1, chunk: int = 8192,
                 backend: str = "auto") -> None:
        if not 0 <= index < peers:
            raise ValueError(f"worker index {index} out of range for {peers} workers")
        if backend not in ("auto", "native", "numpy"):
            raise ValueError(f"backend must be 'auto', 'native' or 'numpy', not {backend!r}")
        if backend == "native" and _native is None:
            raise ImportError("the native generator (nexmark.nexmark_gen) is not built: run `make build`")
        self.config = config
        self.index = index
        self.peers = peers
        self.next = index  # the next event number this worker generates
        self.pools = _get_pools()
        self.native = None
        if backend != "numpy" and _native is not None:
            c, pools = config, self.pools
            self.native = _native.Native(
                (c.rate, c.time_dilation, _as_int64(c.seed), c.active_people, c.in_flight_auctions, c.hot_seller_ratio,
                 c.hot_auction_ratio, c.hot_bidder_ratio, c.hot_ratio_2, c.num_categories, c.first_category_id,
                 c.first_person_id, c.first_auction_id, c.person_id_lead, c.auction_id_lead, c.person_proportion,
                 c.auction_proportion, c.denominator),
                *(list(x) for x in (pools.names, pools.emails, pools.cards, pools.items, pools.descriptions,
                                    pools.cities, pools.states)))
        self.chunk = chunk * peers  # event numbers per generated chunk (chunk events of this worker)
        self._buf: list[tuple[np.ndarray, list]] | None = None
        self._buf_hi = 0
        self._buf_pos = [0, 0, 0]

    def numbers(self, lo: int, hi: int) -> np.ndarray:
        """This worker's event numbers in ``[lo, hi)``."""
        start = lo + (self.index - lo) % self.peers
        return np.arange(start, max(start, hi), self.peers, dtype=np.int64)

    def until(self, hi: int) -> EventBatch:
        """This worker's events from the cursor up to (excluding) event ``hi``; advances the cursor.

        Events are generated ahead in chunks of at least ``chunk`` event numbers (numpy's per-call
        overhead would dominate 1 ms batches) and handed out in slices.
        """
        if self.native is not None:
            if hi <= self.next:
                return EventBatch([], [], [])
            batch = EventBatch(*self.native.generate(self.next, hi, self.index, self.peers))
            self.next = hi + (self.index - hi) % self.peers
            return batch
        out: list[list] = [[], [], []]
        while self.next < hi:
            if self._buf is None or self.next >= self._buf_hi:
                lo = self.next
                self._buf_hi = max(hi, lo + self.chunk)
                n = self.numbers(lo, self._buf_hi)
                self._buf = self._split(n)
                self._buf_pos = [0, 0, 0]
            stop = min(hi, self._buf_hi)
            for k, (nums, recs) in enumerate(self._buf):
                pos = self._buf_pos[k]
                end = int(np.searchsorted(nums, stop))
                if end > pos:
                    out[k].extend(recs[pos:end])
                self._buf_pos[k] = end
            self.next = stop + (self.index - stop) % self.peers
            if self.next >= self._buf_hi:
                self._buf = None
        return EventBatch(*out)

    def events(self, lo: int, hi: int) -> EventBatch:
        """This worker's events with numbers in ``[lo, hi)``, as tuples split by kind."""
        if self.native is not None:
            return EventBatch(*self.native.generate(lo, max(lo, hi), self.index, self.peers))
        return EventBatch(*(recs for _, recs in self._split(self.numbers(lo, hi))))

    def _split(self, n: np.ndarray) -> list[tuple[np.ndarray, list]]:
        """(event numbers, records) per kind for the given event numbers (ascending)."""
        c = self.config
        rem = n % c.denominator
        p_end = c.person_proportion
        a_end = p_end + c.auction_proportion
        kinds = [n[rem < p_end], n[(rem >= p_end) & (rem < a_end)], n[rem >= a_end]]
        return [(k, make(k)) for k, make in zip(kinds, (self._persons, self._auctions, self._bids))]

    # -- columns -------------------------------------------------------------------------------
    def _date_time(self, n: np.ndarray) -> np.ndarray:
        c = self.config
        return (n * (1000 * c.time_dilation)) // c.rate

    def _last_person(self, n: np.ndarray) -> np.ndarray:
        c = self.config
        off = np.minimum(n % c.denominator, c.person_proportion - 1)
        return (n // c.denominator) * c.person_proportion + off

    def _last_auction(self, n: np.ndarray) -> np.ndarray:
        c = self.config
        epoch = n // c.denominator
        off = n % c.denominator
        before = off < c.person_proportion
        after = off >= c.person_proportion + c.auction_proportion
        epoch = np.where(before, epoch - 1, epoch)
        off = np.where(before | after, c.auction_proportion - 1, off - c.person_proportion)
        return epoch * c.auction_proportion + off

    def _next_person(self, n: np.ndarray, h: np.ndarray) -> np.ndarray:
        c = self.config
        people = self._last_person(n) + 1
        active = np.minimum(people, c.active_people)
        return people - active + _below(h, active + c.person_id_lead)

    def _next_auction(self, n: np.ndarray, h: np.ndarray) -> np.ndarray:
        c = self.config
        hi = self._last_auction(n)
        lo = np.maximum(hi - c.in_flight_auctions, 0)
        return lo + _below(h, hi - lo + 1 + c.auction_id_lead)

    def _persons(self, n: np.ndarray) -> list:
        if not len(n):
            return []
        c, pools = self.config, self.pools
        h0, h1 = _hashes(n, c.seed, 2)
        ids = (self._last_person(n) + c.first_person_id).tolist()
        names = pools.names[_below(h0, len(pools.names))].tolist()
        emails = pools.emails[_below(h0 >> np.uint64(20), _POOL)].tolist()
        cards = pools.cards[_below(h0 >> np.uint64(40), _POOL)].tolist()
        cities = pools.cities[_below(h1, len(pools.cities))].tolist()
        states = pools.states[_below(h1 >> np.uint64(20), len(pools.states))].tolist()
        return list(zip(ids, names, emails, cards, cities, states, self._date_time(n).tolist()))

    def _auctions(self, n: np.ndarray) -> list:
        if not len(n):
            return []
        c, pools = self.config, self.pools
        h0, h1, h2, h3 = _hashes(n, c.seed, 4)
        initial = _price(h0)
        reserve = initial + _price(h1)
        hot = _below(h2, c.hot_seller_ratio) > 0
        hot_seller = (self._last_person(n) // c.hot_ratio_2) * c.hot_ratio_2
        seller = np.where(hot, hot_seller, self._next_person(n, h2 >> np.uint64(8))) + c.first_person_id
        category = c.first_category_id + _below(h3, c.num_categories)
        dt = self._date_time(n)
        ahead = (c.in_flight_auctions * c.denominator) // c.auction_proportion
        horizon = self._date_time(n + ahead) - dt
        expires = dt + 1 + _below(h3 >> np.uint64(8), np.maximum(horizon * 2, 1))
        items = pools.items[_below(h2 >> np.uint64(40), _POOL)].tolist()
        descs = pools.descriptions[_below(h3 >> np.uint64(48), _POOL)].tolist()
        ids = (self._last_auction(n) + c.first_auction_id).tolist()
        return list(zip(ids, items, descs, initial.tolist(), reserve.tolist(), dt.tolist(), expires.tolist(),
                        seller.tolist(), category.tolist()))

    def _bids(self, n: np.ndarray) -> list:
        if not len(n):
            return []
        return list(zip(*(col.tolist() for col in self.bid_columns(n))))

    def bid_columns(self, n: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
        """The bids with event numbers ``n`` (each a bid's number) as int64 columns ``(auction,
        bidder, price, date_time)``: the bids' records without a Python object per bid."""
        c = self.config
        h0, h1 = _hashes(n, c.seed, 2)
        hot_auction = (self._last_auction(n) // c.hot_ratio_2) * c.hot_ratio_2
        auction = np.where(_below(h0, c.hot_auction_ratio) > 0, hot_auction,
                           self._next_auction(n, h0 >> np.uint64(16))) + c.first_auction_id
        hot_bidder = (self._last_person(n) // c.hot_ratio_2) * c.hot_ratio_2 + 1
        bidder = np.where(_below(h0 >> np.uint64(8), c.hot_bidder_ratio) > 0, hot_bidder,
                          self._next_person(n, h0 >> np.uint64(32))) + c.first_person_id
        return auction, bidder, _price(h1), self._date_time(n)


def generate(config: Config, lo: int, hi: int, index: int = 0, peers: int = 1) -> EventBatch:
    """The events ``lo <= n < hi`` that worker ``index`` of ``peers`` generates."""
    return Generator(config, index, peers).events(lo, hi)

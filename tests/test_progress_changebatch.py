"""Property tests for ``ChangeBatch`` against a dict of sums: updates, extends, drains and
``drain_into`` keep exactly the non-zero totals, sorted, whatever the order of the updates."""
from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

from timely.progress import ChangeBatch

FAST = settings(max_examples=150, deadline=None)


KEY_STRATEGIES = {
    "int": st.integers(-3, 6),
    "pair": st.tuples(st.integers(0, 3), st.integers(0, 3)),
    "loc_time": st.tuples(st.tuples(st.integers(0, 2), st.integers(0, 1), st.booleans()), st.integers(0, 4)),
}


def model_items(model: dict) -> list:
    return sorted((k, v) for k, v in model.items() if v != 0)


def check_batch(batch: ChangeBatch, model: dict, keys) -> None:
    items = model_items(model)
    assert batch.items() == items
    assert list(batch) == items
    assert len(batch) == len(items)
    assert batch.is_empty() == (not items)
    for k in keys:
        assert batch.get(k) == model.get(k, 0)


@FAST
@given(st.data())
def test_change_batch_matches_dict_of_sums(data):
    key = data.draw(st.sampled_from(sorted(KEY_STRATEGIES)), label="key kind")
    keys = KEY_STRATEGIES[key]
    diff = st.integers(-3, 3)  # includes 0, which must be ignored
    op = st.one_of(
        st.tuples(st.just("update"), st.integers(0, 1), keys, diff),
        st.tuples(st.just("extend"), st.integers(0, 1), st.lists(st.tuples(keys, diff), max_size=8)),
        st.tuples(st.just("drain"), st.integers(0, 1)),
        st.tuples(st.just("drain_into"), st.integers(0, 1)),
        st.tuples(st.just("fresh"), st.integers(0, 1), st.lists(st.tuples(keys, diff), max_size=8)),
    )
    ops = data.draw(st.lists(op, max_size=40), label="ops")
    batches = [ChangeBatch(), ChangeBatch()]
    models: list[dict] = [{}, {}]
    seen_keys: set = set()
    for o in ops:
        i = o[1]
        if o[0] == "update":
            _, _, k, d = o
            seen_keys.add(k)
            batches[i].update(k, d)
            models[i][k] = models[i].get(k, 0) + d
        elif o[0] in ("extend", "fresh"):
            upd = o[2]
            seen_keys.update(k for k, _ in upd)
            if o[0] == "fresh":
                batches[i] = ChangeBatch(upd)
                models[i] = {}
            else:
                batches[i].extend(upd)
            for k, d in upd:
                models[i][k] = models[i].get(k, 0) + d
        elif o[0] == "drain":
            out = batches[i].drain()
            assert out == model_items(models[i])
            # sorted, unique keys, no zeros
            ks = [k for k, _ in out]
            assert ks == sorted(set(ks))
            assert all(v != 0 for _, v in out)
            models[i] = {}
        else:  # drain_into the other batch
            j = 1 - i
            batches[i].drain_into(batches[j])
            for k, v in models[i].items():
                models[j][k] = models[j].get(k, 0) + v
            models[i] = {}
        for b, m in zip(batches, models):
            check_batch(b, m, seen_keys)
    # The two batches are independent objects after any sequence of swaps (no aliasing).
    for k in list(seen_keys)[:3]:
        batches[0].update(k, 1)
        models[0][k] = models[0].get(k, 0) + 1
        check_batch(batches[0], models[0], seen_keys)
        check_batch(batches[1], models[1], seen_keys)
    # Equality depends only on the totals.
    assert (batches[0] == batches[1]) == (model_items(models[0]) == model_items(models[1]))
    assert batches[0] == ChangeBatch(model_items(models[0]))


@FAST
@given(
    st.lists(st.tuples(st.tuples(st.integers(0, 3), st.integers(0, 3)), st.integers(-2, 2)), max_size=20),
    st.randoms(use_true_random=False),
)
def test_change_batch_order_independent(updates, rnd):
    a = ChangeBatch(updates)
    shuffled = list(updates)
    rnd.shuffle(shuffled)
    b = ChangeBatch()
    for k, d in shuffled:
        b.update(k, d)
    assert a == b
    assert a.drain() == b.drain()
    assert a.is_empty() and b.is_empty()


def test_change_batch_examples():
    b = ChangeBatch([(3, 1), (1, 2), (3, -1), (2, 0)])
    assert b.items() == [(1, 2)]
    b.update(1, -2)
    assert b.is_empty() and b.drain() == []
    a = ChangeBatch([(5, 1)])
    c = ChangeBatch([(5, -1), (7, 1)])
    a.drain_into(c)
    assert a.is_empty() and c.items() == [(7, 1)]


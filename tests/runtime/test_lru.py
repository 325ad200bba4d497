"""BytesLRU: the bounded map the store's spec cache and the worker's plan memo share."""

from __future__ import annotations

from services.runtime.lru import BytesLRU


def test_least_recently_used_goes_first_when_the_count_is_reached():
    lru = BytesLRU(items=2)
    lru.put("a", b"1")
    lru.put("b", b"2")
    assert lru.get("a") == b"1"  # a is now the most recent
    lru.put("c", b"3")
    assert (lru.get("a"), lru.get("b"), lru.get("c"), len(lru)) == (b"1", None, b"3", 2)


def test_the_byte_bound_counts_a_replaced_value_once():
    lru = BytesLRU(items=10, max_bytes=10)
    lru.put("a", b"x" * 6)
    lru.put("a", b"y" * 6)  # replaced: 6 bytes held, not 12
    lru.put("b", b"z" * 4)
    assert (lru.get("a"), lru.get("b")) == (b"y" * 6, b"z" * 4)
    lru.put("c", b"w")  # 11 bytes: the least recent (a) goes
    assert (lru.get("a"), len(lru)) == (None, 2)


def test_a_value_larger_than_the_bound_is_not_kept_and_clear_empties():
    lru = BytesLRU(items=10, max_bytes=4)
    lru.put("big", b"12345")
    lru.put("a", b"1234")
    assert (lru.get("big"), lru.get("a")) == (None, b"1234")
    lru.clear()
    lru.put("b", b"1234")  # the bytes held went back to 0: b fits beside nothing
    assert (lru.get("a"), lru.get("b"), len(lru)) == (None, b"1234", 1)

"""Block hashes: a chain over model, salt and full blocks (protocols/prefix_hash.py)."""
import pytest

from protocols.prefix_hash import EMPTY_HASH, block_hashes


def test_one_hash_per_full_block_and_a_shared_prefix_shares_hashes():
    a = block_hashes(list(range(40)), 16, "m")
    b = block_hashes(list(range(32)) + [7] * 20, 16, "m")
    assert len(a) == 2 and len(b) == 3
    assert a == b[:2] and EMPTY_HASH not in a + b


def test_a_block_hash_depends_on_everything_before_it():
    base = list(range(48))
    changed = [99] + base[1:]
    assert all(x != y for x, y in zip(block_hashes(base, 16, "m"), block_hashes(changed, 16, "m")))


@pytest.mark.parametrize("other", [("m2", ""), ("m", "tenant-b")])
def test_model_and_salt_separate_chains(other):
    ids = list(range(32))
    assert set(block_hashes(ids, 16, "m", "")).isdisjoint(block_hashes(ids, 16, *other))


def test_limit_and_bad_block_size():
    assert len(block_hashes(list(range(64)), 16, "m", limit=2)) == 2
    with pytest.raises(ValueError):
        block_hashes([1, 2], 0, "m")

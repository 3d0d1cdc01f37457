"""Every block tier speaks the one store contract, with the contract's parameter names."""

import inspect

from cluster.kvcache.disk_client import DiskClient
from cluster.store.contract import BlockStore, leading
from cluster.store.ram_tier import RamTier


def test_the_ram_and_disk_tiers_implement_the_store_contract():
    for tier in (RamTier, DiskClient):
        for name in ("present", "get_many", "put", "discard", "stats"):
            want = list(inspect.signature(getattr(BlockStore, name)).parameters)
            have = list(inspect.signature(getattr(tier, name)).parameters)
            assert have[:len(want)] == want, (tier.__name__, name, have)
    assert isinstance(RamTier(1 << 20), BlockStore)


def test_leading_counts_the_consecutive_prefix():
    assert [leading(f) for f in ([], [True, True, False, True], [False, True])] == [0, 2, 0]

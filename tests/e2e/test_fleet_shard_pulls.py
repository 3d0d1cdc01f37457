"""Two sharded replicas (`up --nodes 4 --shards 2`): a prefix one of them computed is pulled by the other, rank
to rank, and its answers are the holder's bitwise.

Each rank keeps its own heads' blocks, so a pull is as many pulls as ranks: the puller's leader reads from the
holder's leader's node, its follower from the holder's follower's node (docs/sharding.md). Bounded load sends
some copies of a hot prompt to the replica that lacks it. Both replicas split the model the same way, so a
pulled prefix plus the prompt's last token gives exactly what the holder computed cold: the text and every
token's logprob are compared bitwise.
"""

from __future__ import annotations

import time
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest

from cluster.bench.common import prompt_tokens
from tests.local_fleet import LocalFleet, route_of

pytestmark = pytest.mark.fleet
MODEL = "tiny-dense"
COPIES = 8  # sent at once: enough that bounded load sends some to the replica without the prefix


@pytest.fixture(scope="module")
def fleet(tmp_path_factory):
    with LocalFleet(tmp_path_factory.mktemp("shard-pulls"), nodes=4, extra=("--shards", "2")) as f:
        yield f


def complete(url: str, prompt: list[int]) -> httpx.Response:
    body = {"model": MODEL, "prompt": prompt, "max_tokens": 8, "temperature": 0, "logprobs": 0}
    r = httpx.post(url + "/v1/completions", json=body, timeout=120)
    assert r.status_code == 200, r.text
    return r


def answer(r: httpx.Response) -> tuple[str, list[float]]:
    choice = r.json()["choices"][0]
    return choice["text"], choice["logprobs"]["token_logprobs"]


def follower_pulls(fleet) -> dict[str, int]:
    """Blocks each replica's follower pulled, by its leader's node (leaders publish them every few seconds)."""
    out = {}
    for r in fleet.status()["replicas"]:
        if r["model"] == MODEL:
            [follower] = r["shards"]["nodes"][1:]
            out[r["node_id"]] = ((follower.get("cache") or {}).get("migration") or {}).get("blocks", 0)
    return out


def test_the_other_replica_pulls_the_prefix_rank_to_rank_and_answers_as_the_holder_did(fleet):
    replicas = [r for r in fleet.status()["replicas"] if r["model"] == MODEL]
    assert len(replicas) == 2 and all(r["shards"]["size"] == 2 for r in replicas)
    assert len({n["node_id"] for r in replicas for n in r["shards"]["nodes"]}) == 4
    rank_of = {n["node_id"]: n["rank"] for r in replicas for n in r["shards"]["nodes"]}

    prompt = prompt_tokens(512, salt=1)
    first = complete(fleet.url, prompt)
    holder, reference = first.headers["x-fleet-node"], answer(first)
    assert len(holder.split(",")) == 2 and route_of(first.headers)["local"] == "0"
    time.sleep(3)  # on the holder's disks, announced in the index

    with ThreadPoolExecutor(COPIES) as pool:
        results = list(pool.map(lambda _: complete(fleet.url, prompt), range(COPIES)))
    pulled = [r for r in results if int(route_of(r.headers)["fetched"]) > 0]
    assert pulled, [r.headers["x-fleet-route"] for r in results]
    leader = holder.split(",")[0]
    holder_node = {rank_of[n]: n for n in holder.split(",")}  # ranks follow node ids, not who leads
    for r in pulled:
        plan, nodes = route_of(r.headers), r.headers["x-fleet-node"]
        # The puller's leader reads from the holder's node of its own rank (the router names that node)
        assert set(nodes.split(",")).isdisjoint(holder.split(",")), (nodes, holder)
        assert plan["from"] == holder_node[rank_of[nodes.split(",")[0]]], (plan, holder, rank_of)
        assert int(plan["fetched"]) + int(plan["local"]) == 511, plan  # the whole prefix: none recomputed
    # Every answer, pulled, restored on the holder or both, is the holder's cold one, logprobs bitwise
    assert [answer(r) for r in results] == [reference] * COPIES

    # The puller's follower pulled its own heads' blocks from its counterpart, on its own node
    puller = pulled[0].headers["x-fleet-node"].split(",")[0]
    deadline = time.monotonic() + 20
    while (pulls := follower_pulls(fleet))[puller] == 0 and time.monotonic() < deadline:
        time.sleep(1)
    # 512 tokens: 8 blocks of 64 for each request that pulled (copies that arrive together each pull, unless
    # the follower holds the blocks by then); the holder's follower pulled nothing
    assert 8 <= pulls[puller] <= 8 * len(pulled) and pulls[leader] == 0, (pulls, len(pulled))

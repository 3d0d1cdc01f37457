"""ModelReplica in this process (no Ray): all its MLX work runs on the model thread, and a stalled
node store never holds up tokens of a sequence that is already decoding."""

import asyncio
import threading
import time

import pytest

from cluster.actors.replica import ModelReplica, stream_interval
from cluster.config import AppConfig, CacheConfig, ModelSpec
from cluster.engine.events import Accepted, Delta, Finished, Started
from cluster.actors.plan import GenerateRequest
from cluster.engine.request import GenerationParams
from cluster.kvcache.store_link import LocalLink
from cluster.store.disk_tier import DiskStore

PROMPT = tuple(range(3, 120))
STALL_S = 10.0


def request(rid: str, prompt=PROMPT, max_tokens: int = 8) -> GenerateRequest:
    return GenerateRequest(request_id=rid, prompt_tokens=tuple(prompt), params=GenerationParams(max_tokens=max_tokens))


async def collect(replica, req) -> list:
    return [e async for events in replica.generate(req) for e in events]


def tokens(events) -> list[int]:
    return [t for e in events if isinstance(e, Delta) for t in e.token_ids]


@pytest.fixture
def app(data_dir, tmp_path, monkeypatch):
    monkeypatch.setenv("MLX_FLEET_NODE_DATA_DIR", str(tmp_path / "node"))
    spec = ModelSpec(name="tiny-dense", source="tiny-dense")
    return AppConfig(models=[spec], data_dir=str(data_dir), cache=CacheConfig(block_tokens=32, disk=False))


def test_a_replica_loads_and_serves_with_every_mlx_call_on_its_model_thread(app):
    replica = ModelReplica(app.models[0], app)  # the guard is armed: any MLX call elsewhere would raise
    try:
        first = asyncio.run(collect(replica, request("a")))
        again = asyncio.run(collect(replica, request("b")))
        assert isinstance(first[0], Accepted) and isinstance(first[-1], Finished)
        assert next(e for e in again if isinstance(e, Started)).cached_tokens == 96
        assert tokens(first) == tokens(again) and len(tokens(first)) == 8
        assert replica.stats()["healthy"] and replica.stats()["finished"] == 2
    finally:
        replica.__del__()


class StallingLink(LocalLink):
    """A node store that stops answering while `stalled` is set (a fault: a hung or swapping store)."""

    def __init__(self, store):
        super().__init__(store)
        self.stalled = threading.Event()

    def _stall(self):
        if self.stalled.is_set():
            time.sleep(STALL_S)

    def present(self, ns, keys, timeout_s=None):
        self._stall()
        return super().present(ns, keys, timeout_s)

    def open_read(self, ns, keys, timeout_s=None):
        self._stall()
        return super().open_read(ns, keys, timeout_s)


class ReplicaWithStallingStore(ModelReplica):
    link: StallingLink

    def _disk_link(self, app):
        ReplicaWithStallingStore.link = StallingLink(DiskStore(self.node.data_dir / "disk", budget=1 << 30))
        return ReplicaWithStallingStore.link


def test_a_stalled_node_store_does_not_delay_a_decoding_sequence(app):
    app = app.model_copy(update={"cache": CacheConfig(block_tokens=32, disk=True)})
    replica = ReplicaWithStallingStore(app.models[0], app)

    async def scenario():
        arrivals: list[float] = []
        decoding = asyncio.Event()

        async def long_decode():
            stream = replica.generate(request("long", max_tokens=6000))
            async for events in stream:
                if any(isinstance(e, Delta) for e in events):
                    arrivals.append(time.monotonic())
                    if len(arrivals) == 5:
                        decoding.set()
                if b_done.is_set():
                    break
            await stream.aclose()  # the client went away: the replica cancels the sequence

        b_done = asyncio.Event()
        a = asyncio.create_task(long_decode())
        await decoding.wait()
        ReplicaWithStallingStore.link.stalled.set()  # from now on the store hangs for 10 s per call
        t0 = time.monotonic()
        b = await collect(replica, request("other", prompt=range(500, 600)))
        t1 = time.monotonic()
        b_done.set()
        await a
        return arrivals, t0, t1, b

    try:
        arrivals, t0, t1, b = asyncio.run(scenario())
    finally:
        ReplicaWithStallingStore.link.stalled.clear()
        replica.__del__()
    assert t1 - t0 >= STALL_S * 0.9  # the new request did wait for the stalled store (in admission)
    assert isinstance(b[-1], Finished)
    during = [t for t in arrivals if t0 <= t <= t1]
    gaps = [y - x for x, y in zip(during, during[1:])]
    assert len(during) > 50 and max(gaps) < 1.0, f"decode stalled: {len(during)} tokens, max gap {max(gaps):.2f}s"


async def concurrently(replica, reqs) -> list[list]:
    return await asyncio.gather(*(collect(replica, r) for r in reqs))


PROMPTS = [tuple(range(3 + i, 60 + 9 * i)) for i in range(4)]


def test_concurrent_requests_decode_in_one_batch_and_answer_as_alone(app):
    replica = ModelReplica(app.models[0], app)
    try:
        alone = [tokens(asyncio.run(collect(replica, request(f"a{i}", p, 12)))) for i, p in enumerate(PROMPTS)]
        together = asyncio.run(concurrently(replica, [request(f"b{i}", p, 12) for i, p in enumerate(PROMPTS)]))
        assert [tokens(e) for e in together] == alone
        stats = replica.stats()
        assert stats["batching"]["batching"] and stats["batching"]["mean_batch"] > 1
        assert stats["batching"]["decode_concurrency"] == app.models[0].max_ongoing_requests
        assert {k: stats[k] for k in ("active", "queued_tokens", "decoding", "waiting")} == \
            {"active": 0, "queued_tokens": 0, "decoding": 0, "waiting": 0}
    finally:
        replica.__del__()


def test_the_message_budget_stretches_each_streams_interval_with_the_number_of_streams():
    assert stream_interval(0.02, 200, 1) == 0.02
    assert stream_interval(0.02, 200, 8) == pytest.approx(0.04)
    assert stream_interval(0.0, 200, 1) == pytest.approx(0.005)
    assert stream_interval(0.02, 0, 64) == 0.02  # no budget


def test_streams_under_a_message_budget_send_few_messages_and_the_same_tokens(app):
    """4 streams with a budget of 0.5 messages/s: each stream's interval is 8 s, longer than the whole
    answer. Until the client has text, each step goes out at once (a first token whose text is pending must
    not hold the first text back 8 s); after the first text, everything up to the end is gathered into one
    message (the end goes out the moment it comes). The tokens are those of an unbounded replica."""
    spec = app.models[0].model_copy(update={"stream_messages_per_s": 0.5})
    replica = ModelReplica(spec, app)
    try:
        async def messages(req):
            return [events async for events in replica.generate(req)]

        async def run():
            return await asyncio.gather(*(messages(request(f"m{i}", p, 12)) for i, p in enumerate(PROMPTS)))

        streamed = asyncio.run(run())
        for msgs in streamed:
            assert isinstance(msgs[0][0], Accepted) and isinstance(msgs[-1][-1], Finished)
            shown = next(i for i, m in enumerate(msgs) if any(isinstance(e, Delta) and e.text for e in m))
            assert len(msgs) - shown - 1 <= 1, [[type(e).__name__ for e in m] for m in msgs]
        assert replica.stats()["streams"] == 0
        alone = [tokens(asyncio.run(collect(replica, request(f"a{i}", p, 12)))) for i, p in enumerate(PROMPTS)]
        assert [tokens([e for m in msgs for e in m]) for msgs in streamed] == alone
    finally:
        replica.__del__()


def test_a_first_token_whose_text_is_held_back_does_not_hold_back_the_first_text(app):
    """PROMPTS[0] answers " User User ..."; with the stop string " User x" the first token's text waits in
    the stop matcher (it may start the stop string), so the message with Started carries no text. The next
    token releases the first " User" (holding the second), and that goes out at once, not after the stream's
    10 s interval; everything after it is gathered into one message."""
    spec = app.models[0].model_copy(update={"stream_messages_per_s": 0.1})
    replica = ModelReplica(spec, app)
    try:
        req = GenerateRequest(request_id="held", prompt_tokens=PROMPTS[0],
                              params=GenerationParams(max_tokens=48, stop=(" User x",)))

        async def messages():
            return [events async for events in replica.generate(req)]

        msgs = asyncio.run(messages())
        texts = ["".join(e.text for e in m if isinstance(e, Delta)) for m in msgs]
        first = next(i for i, t in enumerate(texts) if t)
        assert isinstance(msgs[1][0], Started) and first >= 2, texts  # Started came with no text
        assert texts[first].startswith(" User") and not isinstance(msgs[first][-1], Finished), texts
        assert len(msgs) == first + 2 and isinstance(msgs[-1][-1], Finished), texts  # the rest, gathered
        plain = asyncio.run(collect(replica, request("plain", PROMPTS[0], 48)))  # the stop string never matches
        assert tokens([e for m in msgs for e in m]) == tokens(plain)
    finally:
        replica.__del__()


def test_a_model_whose_caches_cannot_batch_is_served_in_turns_and_says_why(app):
    app = app.model_copy(update={"cache": app.cache.model_copy(update={"kv_codec": "q8"})})
    replica = ModelReplica(app.models[0], app)
    try:
        alone = [tokens(asyncio.run(collect(replica, request(f"a{i}", p, 8)))) for i, p in enumerate(PROMPTS)]
        together = asyncio.run(concurrently(replica, [request(f"b{i}", p, 8) for i, p in enumerate(PROMPTS)]))
        assert [tokens(e) for e in together] == alone
        batching = replica.stats()["batching"]
        assert batching["batching"] is False and batching["batched_steps"] == 0
        assert batching["reason"].startswith("QuantizedKVCache has no batched form")
    finally:
        replica.__del__()


def test_a_restarted_replica_starts_from_the_speeds_its_predecessor_measured(app):
    first = ModelReplica(app.models[0], app)
    try:
        asyncio.run(collect(first, request("a")))
        measured = first.scheduler.prefill_tps
        assert measured > 0
    finally:
        first.__del__()  # saves what it measured
    assert first.speeds_path.is_file()
    second = ModelReplica(app.models[0], app)
    try:
        assert second.speeds_path == first.speeds_path
        assert second.scheduler.prefill_tps == measured  # before it has served anything
        assert second.stats()["cache"]["costs"]["prefill_tps"] == round(measured, 1)
    finally:
        second.__del__()


def test_a_deterministic_replica_decodes_batch_invariant_and_says_how(app):
    """On the CPU the mode routes attention per row and leaves matmuls as they are (tests/engine/test_invariant.py)."""
    replica = ModelReplica(app.models[0].model_copy(update={"deterministic": True}), app)
    try:
        asyncio.run(collect(replica, request("a")))
        batching = replica.stats()["batching"]
        assert batching["deterministic"] == "per-row attention (this backend's matmuls are row-exact)"
        assert (replica.scheduler.invariant, replica.scheduler.pad_rows) == (True, False)
        assert type(replica.model.model.layers[0].self_attn.q_proj).__name__ == "_RowsLinear"
    finally:
        replica.__del__()

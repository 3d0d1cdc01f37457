"""Locust users for an OpenAI-compatible fleet, with TTFT split by cache state.

    locust -f loadtest/locustfile.py --headless -u 4 -r 2 -t 30s --host http://127.0.0.1:8000 --csv out

needs nothing else: the model is the first one /v1/models lists (`--model` picks
another), and every workload option has a default. One user class per workload
(run some: `locust -f ... SharedPromptUser`), each task tagged with the workload's
name (or: `--tags shared docqa`). See loadtest/workloads.py for what they ask.

What locust's UI and CSV show, next to each workload's POST row (its time is the
whole streamed answer):

    TTFT   cold | partial | full     time to the first content chunk, by how much of the prompt
                                     the fleet restored (usage.prompt_tokens_details.cached_tokens)
    ITL    inter-token               time per token after the first, one sample per request
    VERIFY cold replay               --verify-fraction of greedy answers asked again with
                                     `x-fleet-cache: bypass`; a different text is a failure

`--records FILE` appends one JSON line per request (and per replay) for the
runner's summary and plots (loadtest/run.py).
"""

from __future__ import annotations

import itertools
import json
import logging
import os
import threading
import time
from dataclasses import asdict, fields
from typing import Optional

import gevent
import requests
from locust import User, between, events, tag, task
from locust.exception import StopUser

from loadtest.stream import Result, cache_state, complete_chat, stream_chat
from loadtest.workloads import (WORKLOADS, AgentLoop, DocumentQA, MultiTurnChat, SharedSystemPrompts, Sizes,
                                UniquePrompts, Workload)

CHAT = "/v1/chat/completions"


class WrongAnswer(Exception):
    """The cached answer differs from the cold one."""


@events.init_command_line_parser.add_listener
def _options(parser) -> None:
    group = parser.add_argument_group("mlx-fleet workloads")
    group.add_argument("--model", default="", help="model to ask (default: the first one /v1/models lists)")
    group.add_argument("--api-key", default="", env_var="OPENAI_API_KEY",
                       help="sent as 'Authorization: Bearer <key>' when the fleet requires one")
    group.add_argument("--max-tokens", type=int, default=16, help="max_tokens of every request")
    group.add_argument("--temperature", type=float, default=0.0, help="0 is greedy (and verifiable)")
    group.add_argument("--workload-seed", type=int, default=0, help="seeds every user's generator")
    group.add_argument("--verify-fraction", type=float, default=0.0,
                       help="share of greedy answers replayed cold (x-fleet-cache: bypass) and compared")
    group.add_argument("--max-requests", type=int, default=0, help="stop after this many requests (0: no limit)")
    group.add_argument("--request-timeout", type=float, default=600.0, help="seconds per request")
    group.add_argument("--records", default="", help="append one JSON line per request to this file")
    for f in fields(Sizes):
        group.add_argument(f"--{f.name.replace('_', '-')}", type=int, default=f.default, help=f"workload size: {f.name}")


class Run:
    """What every user of this locust process shares: the options, the model, the records file."""

    lock = threading.Lock()
    model: Optional[str] = None
    block_tokens = 0
    records = None
    requests = 0
    greedy = 0
    counters: dict = {}

    @classmethod
    def verify_next(cls, fraction: float) -> bool:
        """Exactly `fraction` of this process's greedy answers, evenly spread (no luck involved)."""
        with cls.lock:
            n = cls.greedy
            cls.greedy += 1
        return int((n + 1) * fraction) > int(n * fraction)

    @classmethod
    def discover(cls, user: "FleetUser") -> None:
        """The model (and its KV block size) from /v1/models, once per process."""
        with cls.lock:
            if cls.model is not None:
                return
            t0 = time.perf_counter()
            r = user.session.get(user.host.rstrip("/") + "/v1/models", headers=user.headers, timeout=30)
            user.environment.events.request.fire(
                request_type="GET", name="/v1/models", response_time=(time.perf_counter() - t0) * 1000,
                response_length=len(r.content), exception=None if r.ok else RuntimeError(f"HTTP {r.status_code}: {r.text[:200]}"),
                context={})
            r.raise_for_status()
            cards = r.json()["data"]
            wanted = user.option("model")
            card = next((c for c in cards if c["id"] == wanted), None) if wanted else cards[0]
            if card is None:
                raise ValueError(f"--model {wanted!r} is not served here; /v1/models lists {[c['id'] for c in cards]}")
            cls.model, cls.block_tokens = card["id"], int(card.get("kv_block_tokens") or 0)

    @classmethod
    def record(cls, row: dict) -> None:
        if cls.records is not None:
            with cls.lock:
                cls.records.write(json.dumps(row) + "\n")
                cls.records.flush()

    @classmethod
    def next_user(cls, workload: str) -> int:
        with cls.lock:
            counter = cls.counters.setdefault(workload, itertools.count())
            return next(counter)


@events.init.add_listener
def _select_by_tag(environment, **_) -> None:
    """`--tags shared docqa` / `--exclude-tags unique` pick workloads. Locust alone would still spawn the
    other users, with no task left to run; here they are not spawned at all."""
    opts = environment.parsed_options
    tags = set(getattr(opts, "tags", None) or ()) if opts else set()
    excluded = set(getattr(opts, "exclude_tags", None) or ()) if opts else set()
    if not tags and not excluded:
        return
    keep = [u for u in environment.user_classes
            if (not tags or u.workload_class.name in tags) and u.workload_class.name not in excluded]
    if not keep:
        raise ValueError(f"no workload matches --tags {sorted(tags)} --exclude-tags {sorted(excluded)}; "
                         f"the workloads are: {', '.join(WORKLOADS)}")
    environment.user_classes[:] = keep


@events.test_start.add_listener
def _open_records(environment, **_) -> None:
    path = getattr(environment.parsed_options, "records", "") if environment.parsed_options else ""
    if path and Run.records is None:
        Run.records = open(path, "a", buffering=1, encoding="utf-8")


@events.quitting.add_listener
def _close_records(environment, **_) -> None:
    if Run.records is not None:
        Run.records.close()
        Run.records = None


class FleetUser(User):
    """Asks its workload's next question, streamed, and reports how it went."""

    abstract = True
    wait_time = between(0.2, 1.0)
    workload_class: type[Workload] = Workload

    def option(self, name: str):
        opts = self.environment.parsed_options
        return getattr(opts, name) if opts is not None and hasattr(opts, name) else _DEFAULTS[name]

    def on_start(self) -> None:
        self.session = requests.Session()
        self.session.trust_env = False  # no proxies: the fleet is spoken to directly
        key = self.option("api_key")
        self.headers = {"Authorization": f"Bearer {key}"} if key else {}
        try:
            Run.discover(self)
        except (requests.RequestException, ValueError, KeyError, IndexError) as e:
            logging.error("cannot start: %s (is --host right, and --api-key / $OPENAI_API_KEY?)", e)
            raise StopUser() from None
        seed = self.option("workload_seed")
        sizes = Sizes(**{f.name: self.option(f.name) for f in fields(Sizes)})
        self.work = self.workload_class(seed, Run.next_user(self.workload_class.name), sizes)

    def on_stop(self) -> None:
        self.session.close()

    def turn(self) -> None:
        body = {"model": Run.model, "messages": self.work.next_messages(), "max_tokens": self.option("max_tokens"),
                "temperature": self.option("temperature")}
        url = self.host.rstrip("/") + CHAT
        started = time.time()
        res = stream_chat(self.session, url, body, self.headers, self.option("request_timeout"))
        state = cache_state(res.prompt_tokens, res.cached_tokens, Run.block_tokens)
        self._report(res, state)
        Run.record(_row("request", self.work.name, started, res, state))
        if res.ok:
            self.work.answered(res.text)
            if body["temperature"] == 0 and Run.verify_next(self.option("verify_fraction")):
                self._verify(url, body, res)
        self._count()

    def _report(self, res: Result, state: str) -> None:
        fire = self.environment.events.request.fire
        error = None if res.ok else RuntimeError(res.error or f"HTTP {res.status}")
        fire(request_type="POST", name=f"{CHAT} [{self.work.name}]", response_time=res.total_s * 1000,
             response_length=len(res.text), exception=error, context={"node": res.node})
        if res.ok and res.ttft_s is not None:
            fire(request_type="TTFT", name=state, response_time=res.ttft_s * 1000, response_length=res.prompt_tokens,
                 exception=None, context={"node": res.node})
        if res.ok and res.itl_s is not None:
            fire(request_type="ITL", name="inter-token", response_time=res.itl_s * 1000,
                 response_length=res.completion_tokens, exception=None, context={"node": res.node})

    def _verify(self, url: str, body: dict, cached: Result) -> None:
        started = time.time()
        cold = complete_chat(self.session, url, body, {**self.headers, "x-fleet-cache": "bypass"},
                             self.option("request_timeout"))
        error = None
        if not cold.ok:
            error = RuntimeError(cold.error or f"HTTP {cold.status}")
        elif cold.text != cached.text:
            error = WrongAnswer(f"{self.work.name}: cached {cached.text!r} != cold {cold.text!r}")
        self.environment.events.request.fire(request_type="VERIFY", name="cold replay",
                                             response_time=cold.total_s * 1000, response_length=len(cold.text),
                                             exception=error, context={"node": cold.node})
        row = _row("verify", self.work.name, started, cold, "cold")
        row["match"] = cold.ok and cold.text == cached.text
        row["cached_state"] = cache_state(cached.prompt_tokens, cached.cached_tokens, Run.block_tokens)
        Run.record(row)

    def _count(self) -> None:
        limit = self.option("max_requests")
        with Run.lock:
            Run.requests += 1
            done = limit and Run.requests == limit
        if done and self.environment.runner is not None:
            gevent.spawn(self.environment.runner.quit)


def _row(kind: str, workload: str, started: float, res: Result, state: str) -> dict:
    route = res.route_fields()
    row = {k: v for k, v in asdict(res).items() if k != "last_s"}
    row.update(kind=kind, workload=workload, t_start=started, t_end=started + res.total_s, ok=res.ok,
               cache_state=state if res.ok else None, itl_s=res.itl_s,
               policy=route["policy"], reason=route.get("reason", ""), local=int(route.get("local", 0)),
               fetched=int(route.get("fetched", 0)), pid=os.getpid())
    return row


_DEFAULTS = {"model": "", "api_key": os.environ.get("OPENAI_API_KEY", ""), "max_tokens": 16, "temperature": 0.0,
             "workload_seed": 0, "verify_fraction": 0.0, "max_requests": 0, "request_timeout": 600.0,
             **{f.name: f.default for f in fields(Sizes)}}


class SharedPromptUser(FleetUser):
    """Many users, a few long system prompts."""

    workload_class = SharedSystemPrompts

    @tag("shared")
    @task
    def ask(self) -> None:
        self.turn()


class ChatUser(FleetUser):
    """Multi-turn sessions whose context grows turn by turn."""

    workload_class = MultiTurnChat

    @tag("chat")
    @task
    def ask(self) -> None:
        self.turn()


class DocumentQAUser(FleetUser):
    """Many questions about a few long documents."""

    workload_class = DocumentQA

    @tag("docqa")
    @task
    def ask(self) -> None:
        self.turn()


class AgentUser(FleetUser):
    """A long tool schema and a growing scratchpad."""

    workload_class = AgentLoop

    @tag("agent")
    @task
    def ask(self) -> None:
        self.turn()


class UniquePromptUser(FleetUser):
    """Nothing shared: the baseline."""

    workload_class = UniquePrompts

    @tag("unique")
    @task
    def ask(self) -> None:
        self.turn()

"""Seeded workloads: what each simulated user asks, turn after turn.

Each workload is a small class with one method, `next_messages()`, that gives the
chat messages of the user's next request, and `answered(text)`, that tells it the
reply (multi-turn workloads put it into the context). A user's generator is
seeded from (run seed, workload, user number), so the same run asks the same
questions in the same order, whatever the fleet answers in between, as long as
the answers are the same (greedy); that is what makes two routing policies
comparable.

Sizes are in words (about one token each with the built-in models' tokenizer) and
default to what a 2-core CPU prefills in about a second; on a Mac raise them
(`--system-words 2000 --doc-words 4000`...).

    shared   many users, a few long system prompts, short questions
    chat     multi-turn sessions whose context grows turn by turn
    docqa    many questions about a few long documents
    agent    a long tool schema, then a scratchpad that grows with every step
    unique   nothing shared: the baseline
"""

from __future__ import annotations

import json
import random
from dataclasses import dataclass

VOCABULARY = (
    "the fleet keeps every prefix it has seen block by block and a replica that lacks one pulls it from a peer "
    "when that is faster than computing it again while the gateway sends each request to the node predicted to "
    "answer first memory disk network model token prompt cache route answer question document system user "
    "assistant search file read write list open close report time date number name value state result step "
    "plan check find make build test run stop start send receive order price city river mountain garden"
).split()


@dataclass(frozen=True)
class Sizes:
    """Prompt sizes, in words. Every workload reads the ones it needs."""

    system_words: int = 300
    question_words: int = 16
    doc_words: int = 500
    tool_words: int = 400
    step_words: int = 60
    unique_words: int = 300
    shared_prompts: int = 3
    documents: int = 4
    max_turns: int = 6


def words(rng: random.Random, n: int) -> str:
    return " ".join(rng.choices(VOCABULARY, k=n))


def sentence(rng: random.Random, n: int, end: str = ".") -> str:
    return words(rng, n).capitalize() + end


class Workload:
    """One user's stream of requests. `shared` is the same for every user of a run; `rng` is theirs."""

    name = ""

    def __init__(self, seed: int, user: int, sizes: Sizes):
        self.sizes = sizes
        self.shared = random.Random(f"{seed}:{self.name}:shared")
        self.rng = random.Random(f"{seed}:{self.name}:{user}")

    def next_messages(self) -> list[dict]:
        raise NotImplementedError

    def answered(self, text: str) -> None:
        """The reply to the last `next_messages()`; single-turn workloads ignore it."""


class SharedSystemPrompts(Workload):
    name = "shared"

    def __init__(self, seed: int, user: int, sizes: Sizes):
        super().__init__(seed, user, sizes)
        self.systems = [f"You are assistant {i}. {sentence(self.shared, sizes.system_words)}"
                        for i in range(sizes.shared_prompts)]

    def next_messages(self) -> list[dict]:
        # Skewed like real traffic: the first prompt is the most used.
        system = self.rng.choices(self.systems, weights=[1 / (i + 1) for i in range(len(self.systems))])[0]
        return [{"role": "system", "content": system},
                {"role": "user", "content": sentence(self.rng, self.sizes.question_words, "?")}]


class Conversation(Workload):
    """Multi-turn: each request is the whole conversation so far plus one new user turn, until
    `max_turns` replies, then a new conversation begins."""

    def __init__(self, seed: int, user: int, sizes: Sizes):
        super().__init__(seed, user, sizes)
        self.messages: list[dict] = []

    def opening(self) -> list[dict]:
        raise NotImplementedError

    def follow_up(self) -> dict:
        raise NotImplementedError

    def next_messages(self) -> list[dict]:
        if self.messages and self.messages[-1]["role"] == "user":
            self.messages.pop()  # the last one got no answer: ask something else in its place
        replies = sum(m["role"] == "assistant" for m in self.messages)
        if not self.messages or replies >= self.sizes.max_turns:
            self.messages = self.opening()
        else:
            self.messages.append(self.follow_up())
        return list(self.messages)

    def answered(self, text: str) -> None:
        self.messages.append({"role": "assistant", "content": text})


class MultiTurnChat(Conversation):
    name = "chat"

    def opening(self) -> list[dict]:
        return [{"role": "system", "content": sentence(self.rng, self.sizes.step_words)}, self.follow_up()]

    def follow_up(self) -> dict:
        return {"role": "user", "content": sentence(self.rng, self.sizes.step_words, "?")}


class DocumentQA(Workload):
    name = "docqa"

    def __init__(self, seed: int, user: int, sizes: Sizes):
        super().__init__(seed, user, sizes)
        self.documents = [f"Document {i}.\n{sentence(self.shared, sizes.doc_words)}" for i in range(sizes.documents)]

    def next_messages(self) -> list[dict]:
        doc = self.rng.choice(self.documents)
        return [{"role": "system", "content": "Answer questions about the document."},
                {"role": "user", "content": f"{doc}\n\nQuestion: {sentence(self.rng, self.sizes.question_words, '?')}"}]


class AgentLoop(Conversation):
    name = "agent"

    def __init__(self, seed: int, user: int, sizes: Sizes):
        super().__init__(seed, user, sizes)
        per_tool = 40
        tools = [{"name": f"tool_{i}", "description": sentence(self.shared, per_tool),
                  "parameters": {"type": "object", "properties": {"query": {"type": "string"}}}}
                 for i in range(max(1, sizes.tool_words // per_tool))]
        self.system = "You can call these tools by writing CALL name(args):\n" + json.dumps(tools, indent=1)

    def opening(self) -> list[dict]:
        return [{"role": "system", "content": self.system},
                {"role": "user", "content": f"Task: {sentence(self.rng, self.sizes.question_words)}"}]

    def follow_up(self) -> dict:
        return {"role": "user", "content": f"Observation: {sentence(self.rng, self.sizes.step_words)}"}


class UniquePrompts(Workload):
    name = "unique"

    def next_messages(self) -> list[dict]:
        return [{"role": "user", "content": sentence(self.rng, self.sizes.unique_words, "?")}]


WORKLOADS: dict[str, type[Workload]] = {w.name: w for w in
                                        (SharedSystemPrompts, MultiTurnChat, DocumentQA, AgentLoop, UniquePrompts)}

"""Workloads: seeded and reproducible, sharing what they claim to share, conversations that grow."""

from loadtest.workloads import WORKLOADS, AgentLoop, DocumentQA, MultiTurnChat, SharedSystemPrompts, Sizes, UniquePrompts

SIZES = Sizes()


def first_requests(cls, seed: int, user: int, n: int = 5) -> list[list[dict]]:
    w = cls(seed, user, SIZES)
    out = []
    for i in range(n):
        out.append(w.next_messages())
        w.answered(f"reply {i}")
    return out


def test_the_same_seed_and_user_ask_the_same_things_and_another_seed_does_not():
    for cls in WORKLOADS.values():
        assert first_requests(cls, 7, 1) == first_requests(cls, 7, 1), cls.name
        assert first_requests(cls, 7, 1) != first_requests(cls, 8, 1), cls.name


def test_shared_system_prompts_are_few_and_the_same_for_every_user():
    systems = {msgs[0]["content"] for user in range(6) for msgs in first_requests(SharedSystemPrompts, 3, user, 10)}
    assert 1 < len(systems) <= SIZES.shared_prompts
    assert all(len(s.split()) > SIZES.system_words for s in systems)


def test_document_questions_share_the_few_documents_and_differ_in_the_question():
    asked = [msgs[1]["content"] for user in range(4) for msgs in first_requests(DocumentQA, 3, user, 6)]
    docs = {a.split("\n\nQuestion:")[0] for a in asked}
    assert len(docs) <= SIZES.documents and len(set(asked)) == len(asked)


def test_a_conversation_grows_by_the_reply_and_one_turn_then_starts_over():
    for cls in (MultiTurnChat, AgentLoop):
        w = cls(0, 0, Sizes(max_turns=3))
        seen = []
        for i in range(5):
            seen.append(w.next_messages())
            w.answered(f"reply {i}")
        assert [len(m) for m in seen] == [2, 4, 6, 2, 4], cls.name
        assert seen[1][:2] == seen[0] and seen[1][2] == {"role": "assistant", "content": "reply 0"}
        assert seen[3][0]["role"] == "system"


def test_an_unanswered_turn_is_replaced_not_doubled():
    w = MultiTurnChat(0, 0, SIZES)
    first = w.next_messages()
    second = w.next_messages()  # no answer came
    assert len(second) == len(first) == 2 and second[0] == first[0] and second[1] != first[1]


def test_the_agent_schema_is_long_and_shared():
    a, b = AgentLoop(0, 0, SIZES), AgentLoop(0, 1, SIZES)
    assert a.next_messages()[0] == b.next_messages()[0]
    assert len(a.system.split()) > SIZES.tool_words


def test_unique_prompts_share_nothing():
    asked = [m[0]["content"] for u in range(3) for m in first_requests(UniquePrompts, 0, u, 4)]
    assert len(set(asked)) == len(asked)
    assert len({a[:80] for a in asked}) == len(asked)  # not even their openings

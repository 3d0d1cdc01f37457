"""The gateway's view of a model: prompts are tokenized and templated on the tokenizer threads, never on
the event loop, and a prompt that cannot fit is refused before any tokenizing."""

import asyncio
import threading
from concurrent.futures import ThreadPoolExecutor

import pytest

from cluster.actors.served_model import ServedModel
from cluster.api.errors import APIError
from cluster.api.schemas import ChatCompletionRequest, CompletionRequest
from cluster.config import ModelSpec


@pytest.fixture(scope="module")
def served(data_dir):
    pool = ThreadPoolExecutor(2, thread_name_prefix="mlx-fleet-tokenize")
    model = ServedModel(ModelSpec(name="tiny-dense", source="tiny-dense"), data_dir, handle=None, executor=pool)
    yield model
    pool.shutdown()


def spy(served, monkeypatch) -> list[str]:
    """The names of the threads the tokenizer runs on."""
    seen = []
    tok = served.tokenizer
    for name in ("encode", "apply_chat_template"):
        real = getattr(tok, name)

        def recording(*args, _real=real, **kwargs):
            seen.append(threading.current_thread().name)
            return _real(*args, **kwargs)

        monkeypatch.setattr(tok, name, recording)
    return seen


def test_prompts_are_tokenized_and_templated_off_the_event_loop(served, monkeypatch):
    seen = spy(served, monkeypatch)
    text = "fleet " * 30_000  # under the cheap bound, over the context once tokenized

    async def both():
        loop_thread = threading.current_thread().name
        chat = await served.chat_prompt(ChatCompletionRequest(model="tiny-dense",
                                                              messages=[{"role": "user", "content": "hi"}]))
        tokens = await served.text_prompt(CompletionRequest(model="tiny-dense", prompt=text))
        return loop_thread, chat, tokens

    loop_thread, chat, tokens = asyncio.run(both())
    assert len(seen) == 2 and all(name.startswith("mlx-fleet-tokenize") for name in seen), seen
    assert loop_thread not in seen and chat and len(tokens) > served.context


def test_a_prompt_that_cannot_fit_is_refused_before_tokenizing(served, monkeypatch):
    seen = spy(served, monkeypatch)
    huge = "word " * (served.context * served.max_token_bytes)  # 2.5 chars a token would still not fit
    with pytest.raises(APIError) as refused:
        asyncio.run(served.text_prompt(CompletionRequest(model="tiny-dense", prompt=huge)))
    assert refused.value.status == 400 and "characters" in refused.value.message and seen == []

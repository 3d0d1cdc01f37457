"""A deterministic byte-level BPE tokenizer with a ChatML template.

Trained on an embedded synthetic corpus, so the built-in models need no
download. Byte-level means every string round-trips; the three special tokens
come first so their ids are fixed: <|endoftext|>=0, <|im_start|>=1,
<|im_end|>=2 (the EOS of the built-in models).

tokenizer_config.json is written by hand with PreTrainedTokenizerFast because
transformers 5's save_pretrained writes a tokenizer class that transformers 4
cannot read (mlx-facts §0.11).
"""

from __future__ import annotations

import json
from pathlib import Path

from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

SPECIAL_TOKENS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]

# ChatML with tools the way Qwen 2.5 writes them (so mlx-lm picks its `json_tools` parser): the tool list
# in a system turn, calls as <tool_call>{"name": ..., "arguments": ...}</tool_call>, results in
# <tool_response> user turns. Without tools it renders exactly the plain ChatML of earlier versions.
CHAT_TEMPLATE = (
    "{% if tools %}"
    "{{ '<|im_start|>system\n' }}"
    "{% if messages[0]['role'] == 'system' %}{{ messages[0]['content'] + '\n\n' }}{% endif %}"
    "{{ '# Tools\n\nYou may call one or more functions to assist with the user query.\n\n'"
    " + 'You are provided with function signatures within <tools></tools> XML tags:\n<tools>' }}"
    "{% for tool in tools %}{{ '\n' + (tool | tojson) }}{% endfor %}"
    "{{ '\n</tools>\n\nFor each function call, return a json object with function name and arguments '"
    " + 'within <tool_call></tool_call> XML tags:\n<tool_call>\n'"
    " + '{\"name\": <function-name>, \"arguments\": <args-json-object>}\n</tool_call><|im_end|>\n' }}"
    "{% endif %}"
    "{% for message in messages %}"
    "{% if tools and loop.first and message['role'] == 'system' %}"
    "{% elif message['role'] == 'assistant' and message.get('tool_calls') %}"
    "{{ '<|im_start|>assistant\n' + (message['content'] or '') }}"
    "{% for tool_call in message['tool_calls'] %}"
    "{% if tool_call.function is defined %}{% set tool_call = tool_call.function %}{% endif %}"
    "{{ '<tool_call>\n{\"name\": \"' + tool_call.name + '\", \"arguments\": '"
    " + (tool_call.arguments | tojson) + '}\n</tool_call>' }}"
    "{% endfor %}"
    "{{ '<|im_end|>\n' }}"
    "{% elif message['role'] == 'tool' %}"
    "{{ '<|im_start|>user\n<tool_response>\n' + message['content'] + '\n</tool_response><|im_end|>\n' }}"
    "{% else %}"
    "{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n' }}"
    "{% endif %}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)

_WORDS = (
    "the of and to in is you that it he was for on are as with his they at be this "
    "have from or one had by word but not what all were we when your can said there "
    "use an each which she do how their if will up other about out many then them "
    "these so some her would make like him into time has look two more write go see "
    "number no way could people my than first water been call who oil its now find "
    "long down day did get come made may part cache block token model fleet serve "
    "request prompt replica node router memory disk network apple silicon metal "
    "prefix hash layer window state attention system user assistant hello world "
    "please answer question document function return value error retry stream"
).split()
_PUNCT = [". ", ", ", "? ", "! ", ": ", "; ", "\n", " (", ") ", " - ", "'s ", " \"", "\" "]


def _corpus(n_sentences: int = 4000) -> list[str]:
    """A fixed pseudo-random English-like corpus (LCG, so it never changes)."""
    state = 12345
    lines = []
    for _ in range(n_sentences):
        words = []
        state = (state * 1103515245 + 12345) % 2**31
        for _ in range(4 + state % 12):
            state = (state * 1103515245 + 12345) % 2**31
            word = _WORDS[state % len(_WORDS)]
            if state % 7 == 0:
                word = word.capitalize()
            if state % 13 == 0:
                word = str(state % 1000)
            words.append(word)
        state = (state * 1103515245 + 12345) % 2**31
        lines.append(" ".join(words) + _PUNCT[state % len(_PUNCT)])
    return lines


def build_tokenizer(out_dir: Path, vocab_size: int = 1024) -> None:
    """Train the BPE and write tokenizer.json, tokenizer_config.json and the specials map."""
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=SPECIAL_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(_corpus(), trainer=trainer)
    tok.save(str(out_dir / "tokenizer.json"))
    config = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": None,
        "eos_token": "<|im_end|>",
        "pad_token": "<|endoftext|>",
        "unk_token": None,
        "add_bos_token": False,
        "add_eos_token": False,
        "clean_up_tokenization_spaces": False,
        "model_max_length": 32768,
        "chat_template": CHAT_TEMPLATE,
    }
    (out_dir / "tokenizer_config.json").write_text(json.dumps(config, indent=2))
    specials = {"eos_token": "<|im_end|>", "pad_token": "<|endoftext|>"}
    (out_dir / "special_tokens_map.json").write_text(json.dumps(specials, indent=2))

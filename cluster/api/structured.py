"""JSON mode: a request's response_format as an llguidance grammar, checked at the door.

The gateway compiles and validates the grammar (a schema llguidance cannot
compile is the client's 400, never a replica's 500); replicas only apply it
(engine/constraints.py). JSON is written the way Python's json.dumps writes it,
", " and ": " with no other whitespace: free whitespace lets a model pad
forever without closing the object.
"""

from __future__ import annotations

import json
from typing import Optional

from cluster.api.errors import bad_request

JSON_STYLE = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}
ANY_OBJECT = {"type": "object"}


def response_grammar(fmt) -> Optional[str]:
    """The grammar for a ResponseFormat (None for text)."""
    if fmt is None or fmt.type == "text":
        return None
    schema = ANY_OBJECT if fmt.type == "json_object" else fmt.json_schema.schema_
    return schema_grammar(schema, "response_format")


def schema_grammar(schema: dict, param: str) -> str:
    from llguidance import LLMatcher

    try:
        grammar = LLMatcher.grammar_from_json_schema(json.dumps(schema), overrides=JSON_STYLE)
    except ValueError as e:
        raise bad_request(f"the JSON schema is not valid: {e}", param)
    error = LLMatcher.validate_grammar(grammar)
    if error:
        raise bad_request(f"the JSON schema cannot be enforced: {error}", param)
    return grammar

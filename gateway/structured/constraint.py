"""What a request asks its output to match, in one shape whatever field said it (`response_format`,
`structured_outputs`, vLLM's older `guided_*`, or tool calling's `tool_choice`)."""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Literal

Kind = Literal["json_schema", "regex", "choice", "grammar"]

# The largest schema, regex or grammar text a request may send (bytes of its JSON/text form): a grammar is
# compiled per request on the gateway's cores, and its size bounds that work before any is done.
MAX_GRAMMAR_BYTES = 64 * 1024
ANY_JSON_OBJECT = {"type": "object"}  # response_format json_object: any object, as OpenAI's JSON mode


@dataclass(frozen=True, slots=True)
class Constraint:
    """One grammar the output must match. `text`: the schema as JSON, the regex, the choices as a JSON list,
    or the grammar (Lark or GBNF); `param`: the request field errors name."""

    kind: Kind
    text: str
    param: str

    @classmethod
    def json_schema(cls, schema: dict | bool, param: str) -> Constraint:
        return cls("json_schema", json.dumps(schema), param)  # key order kept: properties come out in it

    @property
    def key(self) -> tuple[str, str]:
        """What the compile cache keys on (with the model)."""
        return self.kind, self.text

"""Request fields the server refuses by name, and how a refusal quotes what the client sent.

The OpenAI schemas (`protocols/openai.py`) read these; docs/api-fields.md lists them for users.
"""

from __future__ import annotations

import json
from typing import Any

# Request fields of OpenAI's API or vLLM's extensions that this server does not honour: a request that sets one
# to anything but a value it honours as it is (listed; None is "not sent") gets a 400 naming the field
# (docs/api-fields.md lists them, and the fields accepted and ignored because they change nothing).
REFUSED_FIELDS: dict[str, tuple] = {
    "min_tokens": (None, 0), "include_stop_str_in_output": (None, False), "skip_special_tokens": (None, True),
    "spaces_between_special_tokens": (None, True), "allowed_token_ids": (None,), "bad_words": (None, []),
    "prompt_logprobs": (None,), "truncate_prompt_tokens": (None,), "use_beam_search": (None, False),
    "length_penalty": (None, 1.0), "logits_processors": (None,), "return_tokens_as_token_ids": (None, False),
    "prompt_embeds": (None,),
}
REFUSED_CHAT_FIELDS: dict[str, tuple] = {
    **REFUSED_FIELDS, "functions": (None, []),
    "function_call": (None, "none", "auto"), "audio": (None,), "modalities": (None, ["text"]),
    "web_search_options": (None,), "add_generation_prompt": (None, True), "continue_final_message": (None, False),
    "chat_template": (None,), "chat_template_kwargs": (None, {}), "documents": (None,), "echo": (None, False),
    "add_special_tokens": (None, False),
}
REFUSED_COMPLETION_FIELDS: dict[str, tuple] = {**REFUSED_FIELDS, "add_special_tokens": (None, True)}
RESPONSE_FORMAT_TYPES = ("text", "json_object", "json_schema")  # OpenAI's

# Content parts of other media, by OpenAI's (and vLLM's) type names: parsed only to be refused by name.
MEDIA_PARTS = {"image_url": "images are", "input_image": "images are", "image": "images are",
               "input_audio": "audio is", "audio_url": "audio is", "video_url": "video is", "file": "files are",
               "input_file": "files are"}


def refusal_message(name: str, value: Any, honoured: tuple) -> str | None:
    """Why `value` of field `name` is refused, or None when it is one of `honoured` (None: not sent)."""
    # 1 == True in Python: a bool must match a bool
    if value is None or any(value == ok and isinstance(value, bool) == isinstance(ok, bool) for ok in honoured):
        return None
    allowed = " or ".join(json.dumps(ok) for ok in honoured if ok is not None)  # as the client writes them
    return (f"'{name}' is not supported by this server: got {short_value(value)}; only "
            f"{allowed + ' or ' if allowed else ''}leaving it out is honoured")


def short_value(value: Any) -> str:
    """A value as an error message may quote it: never a whole array or object sent by the client."""
    if isinstance(value, list):
        return f"a list of {len(value)} item{'s' * (len(value) != 1)}"
    if isinstance(value, dict):
        return "an object"
    text = json.dumps(value)
    return text if len(text) <= 40 else text[:37] + "..."

TOOL_CHOICES = ("none", "auto", "required")  # OpenAI's; or {"type": "function", "function": {"name": ...}}

"""Tokenization and the model's own chat template, run off the event loop."""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import Sequence
from concurrent.futures import Executor
from pathlib import Path
from typing import Any

import jinja2
from jinja2.sandbox import ImmutableSandboxedEnvironment
from tokenizers import Tokenizer

from ..streaming import stream_round
from .detokenize import TokenPieces
from .token_text import TokenTexts


class TemplateError(ValueError):
    """The chat template refused the conversation (its own `raise_exception`) or failed to render."""


def _raise_exception(message: str) -> None:
    raise TemplateError(message)


def _tojson(value: Any, indent: int | None = None, **_: Any) -> str:
    return json.dumps(value, ensure_ascii=False, indent=indent)


def _strftime_now(fmt: str) -> str:
    return time.strftime(fmt)


def _token_text(value: Any) -> str | None:
    """tokenizer_config.json writes special tokens as strings or as {"content": ...} objects."""
    if isinstance(value, dict):
        return value.get("content")
    return value


def load_chat_template(model_dir: Path, config: dict) -> str | None:
    """The template source: tokenizer_config.json's `chat_template` or a chat_template.jinja file."""
    template = config.get("chat_template")
    if isinstance(template, list):  # named templates: [{"name": "default", "template": ...}, ...]
        named = {t.get("name"): t.get("template") for t in template}
        template = named.get("default") or next(iter(named.values()), None)
    if template is None and (model_dir / "chat_template.jinja").is_file():
        template = (model_dir / "chat_template.jinja").read_text()
    return template


class ChatTemplate:
    """A Hugging Face chat template, rendered with jinja2 in a sandbox the way `transformers` does."""

    def __init__(self, source: str, special_tokens: dict[str, str | None]):
        env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True,
                                            extensions=["jinja2.ext.loopcontrols"])
        env.filters["tojson"] = _tojson
        env.globals["raise_exception"] = _raise_exception
        env.globals["strftime_now"] = _strftime_now
        self._template = env.from_string(source)
        self.source = source  # read for tool support and the model's tool-call format (gateway/structured/tools.py)
        self._special_tokens = special_tokens

    def render(self, messages: Sequence[dict], add_generation_prompt: bool = True,
               tools: Sequence[dict] | None = None) -> str:
        """`tools`: OpenAI-shaped tool definitions, for a template that lists them itself (None: not passed)."""
        extra = {"tools": list(tools)} if tools is not None else {}
        try:
            return self._template.render(messages=list(messages), add_generation_prompt=add_generation_prompt,
                                         **self._special_tokens, **extra)
        except TemplateError:
            raise
        except jinja2.TemplateError as exc:
            raise TemplateError(f"chat template failed: {exc}") from exc


class TokenizerService:
    """One model's tokenizer and chat template. The async methods run in `executor` threads."""

    def __init__(self, model_dir: str | Path, executor: Executor | None = None):
        self.model_dir = Path(model_dir)
        self.tokenizer = Tokenizer.from_file(str(self.model_dir / "tokenizer.json"))
        config_path = self.model_dir / "tokenizer_config.json"
        config = json.loads(config_path.read_text()) if config_path.is_file() else {}
        special = {name: _token_text(config.get(name))
                   for name in ("bos_token", "eos_token", "unk_token", "pad_token")}
        source = load_chat_template(self.model_dir, config)
        self.chat_template = ChatTemplate(source, special) if source else None
        self.token_texts = TokenTexts(self.tokenizer)
        self.single_texts: dict[int, str] = {}  # id -> decode([id]) without special tokens (detokenize.py)
        self.token_pieces = TokenPieces.for_tokenizer(self.tokenizer, self.token_texts)  # None: streams decode a window
        if self.token_pieces is not None:
            self.token_pieces.warm()
            stream_round.table_for(self.token_pieces)  # made here, off the event loop, for the native round
        self._executor = executor

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return self.tokenizer.encode(text, add_special_tokens=add_special_tokens).ids

    @property
    def template_source(self) -> str | None:
        return self.chat_template.source if self.chat_template is not None else None

    def render_chat(self, messages: Sequence[dict], add_generation_prompt: bool = True,
                    tools: Sequence[dict] | None = None) -> str:
        if self.chat_template is None:
            raise TemplateError(f"the model in {self.model_dir} has no chat template; use /v1/completions")
        return self.chat_template.render(messages, add_generation_prompt, tools)

    def encode_chat_sync(self, messages: Sequence[dict], add_generation_prompt: bool = True,
                         add_special_tokens: bool = False, tools: Sequence[dict] | None = None) -> list[int]:
        # The template writes BOS and the role markers itself: by default no special tokens on top.
        return self.encode(self.render_chat(messages, add_generation_prompt, tools), add_special_tokens)

    async def encode_chat(self, messages: Sequence[dict], add_generation_prompt: bool = True,
                          add_special_tokens: bool = False, tools: Sequence[dict] | None = None) -> list[int]:
        return await self._run(self.encode_chat_sync, messages, add_generation_prompt, add_special_tokens, tools)

    async def encode_prompt(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return await self._run(self.encode, text, add_special_tokens)

    async def decode(self, ids: Sequence[int]) -> str:
        """Ids back to text, special tokens included (so tokenize -> detokenize round-trips)."""
        return await self._run(self.tokenizer.decode, list(ids), False)

    async def _run(self, fn, *args):
        return await asyncio.get_running_loop().run_in_executor(self._executor, fn, *args)

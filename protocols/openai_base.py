"""The base of the OpenAI request schemas (`protocols/openai.py`, `protocols/openai_structured.py`): strict
types, and the error that names the field."""

from __future__ import annotations

from typing import Any

from pydantic import BaseModel, ConfigDict, Field


class InvalidRequest(ValueError):
    """A request body that does not fit the schema; `param` names the field (None for the whole body)."""

    def __init__(self, message: str, param: str | None = None):
        super().__init__(message)
        self.message = message
        self.param = param


class StrictRequest(BaseModel):
    model_config = ConfigDict(strict=True, extra="ignore")

    def check(self) -> None:
        """Rules beyond types and ranges; raise `InvalidRequest` naming the field."""


def omit_none(default: Any = None) -> Any:
    return Field(default=default, exclude_if=lambda v: v is None)

"""Gateway logging: plain text for people, or one JSON object per line (`--log-format json`) for
log pipelines. Fields passed with `extra=` (request_id, slot, token counts, times) become JSON keys."""

from __future__ import annotations

import json
import logging
import time

LOG_FORMATS = ("text", "json")
TEXT_FORMAT = "%(asctime)s %(levelname)s %(name)s: %(message)s"
_RECORD_ATTRS = frozenset(logging.LogRecord("", 0, "", 0, "", (), None).__dict__) | {"message", "asctime"}


class JsonFormatter(logging.Formatter):
    """One JSON object per record: ts (UTC, ISO 8601), level, logger, msg, then the record's extras."""

    def format(self, record: logging.LogRecord) -> str:
        ts = time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime(record.created)) + f".{int(record.msecs):03d}Z"
        out = {"ts": ts, "level": record.levelname, "logger": record.name, "msg": record.getMessage()}
        out.update((k, v) for k, v in record.__dict__.items() if k not in _RECORD_ATTRS)
        if record.exc_info:
            out["exc"] = self.formatException(record.exc_info)
        return json.dumps(out, default=str)


def setup_logging(level: str = "INFO", log_format: str = "text") -> None:
    """Replace the root handlers (a parent such as `blink` may have set some already)."""
    if log_format not in LOG_FORMATS:
        raise ValueError(f"log format must be one of {', '.join(LOG_FORMATS)}, got {log_format!r}")
    handler = logging.StreamHandler()
    handler.setFormatter(JsonFormatter() if log_format == "json" else logging.Formatter(TEXT_FORMAT))
    logging.basicConfig(level=level.upper(), handlers=[handler], force=True)

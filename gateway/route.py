"""Which backend serves a request: the least loaded of those serving the model and not stalled."""

from __future__ import annotations

from collections.abc import Iterable

from .backends import Backend
from .errors import ApiError, unavailable


class Router:
    def __init__(self, backends: Iterable[Backend]):
        self.backends = list(backends)
        self._by_model: dict[str, list[Backend]] = {}
        for backend in self.backends:
            self._by_model.setdefault(backend.info.model_name, []).append(backend)

    @property
    def model_names(self) -> list[str]:
        return list(self._by_model)

    def backends_for(self, model: str) -> list[Backend]:
        """Backends serving `model`; a 404 `model_not_found` error when none does."""
        candidates = self._by_model.get(model)
        if not candidates:
            raise ApiError(404, f"the model '{model}' does not exist; this server has: "
                           f"{', '.join(self.model_names) or 'no models'}", param="model",
                           code="model_not_found")
        return candidates

    def pick(self, model: str) -> Backend:
        candidates = self.backends_for(model)
        live = [b for b in candidates if not b.stalled and not getattr(b, "draining", False)]
        if not live:
            why = "stalled or draining" if any(getattr(b, "draining", False) for b in candidates) else "stalled"
            raise unavailable(f"every backend serving '{model}' is {why}; retry later")
        return min(live, key=lambda b: b.load)

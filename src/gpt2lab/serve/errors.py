"""OpenAI's error body: ``APIError`` (a status and OpenAI's ``{"error": {...}}``), and what a request the
engine could not take or finish answers (``failed``)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

from fastapi.responses import JSONResponse


@dataclass(eq=False)
class APIError(Exception):
    status: int
    message: str
    param: Optional[str] = None
    code: Optional[str] = None
    kind: str = "invalid_request_error"

    def __post_init__(self) -> None:
        super().__init__(self.message)

    def response(self, headers: Optional[dict] = None) -> JSONResponse:
        body = error_body(self.message, self.kind, self.param, self.code)
        return JSONResponse(status_code=self.status, content=body, headers=headers)


def error_body(
    message: str, kind: str = "invalid_request_error", param: Optional[str] = None, code: Optional[str] = None
) -> dict:
    # a request's text may hold lone surrogates ("\ud800" in its JSON), which UTF-8 cannot encode: they
    # are shown escaped, in the message and in the parameter it names, so that the answer is still JSON
    shown = lambda text: text and text.encode("utf-8", "backslashreplace").decode("utf-8")  # noqa: E731
    return {"error": {"message": shown(message), "type": kind, "param": shown(param), "code": code}}


def failed(e: Exception) -> APIError:
    """What a request the engine refused (a full queue, a request past --timeout, a shutdown: their ``answer``)
    or that failed while it ran answers: a refusal's status, else 500."""
    if hasattr(e, "answer"):
        status, kind, code = e.answer
        return APIError(status, str(e), code=code, kind=kind)
    return APIError(500, f"generation failed: {e}", kind="server_error")

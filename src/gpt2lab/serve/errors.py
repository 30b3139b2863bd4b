"""OpenAI's error body: ``APIError`` (a status and OpenAI's ``{"error": {...}}``), and what a request the
engine could not take or finish answers (``failed``)."""

from __future__ import annotations

from typing import Optional

from fastapi.responses import JSONResponse

from gpt2lab.serve.engine import QueueFull, ShuttingDown, TimedOut


class APIError(Exception):
    def __init__(
        self,
        status: int,
        message: str,
        param: Optional[str] = None,
        code: Optional[str] = None,
        kind: str = "invalid_request_error",
    ) -> None:
        super().__init__(message)
        self.status, self.message, self.param, self.code, self.kind = status, message, param, code, kind

    def response(self, headers: Optional[dict] = None) -> JSONResponse:
        body = error_body(self.message, self.kind, self.param, self.code)
        return JSONResponse(status_code=self.status, content=body, headers=headers)


def error_body(
    message: str, kind: str = "invalid_request_error", param: Optional[str] = None, code: Optional[str] = None
) -> dict:
    # a request's text may hold lone surrogates ("\ud800" in its JSON), which UTF-8 cannot encode:
    # they are shown escaped, so that the answer is still JSON
    message = message.encode("utf-8", "backslashreplace").decode("utf-8")
    return {"error": {"message": message, "type": kind, "param": param, "code": code}}


# status, type and code of the engine's refusals: a full queue, a request past --timeout, a shutdown (Ctrl-C)
REFUSALS = {
    QueueFull: (429, "server_busy", "queue_full"),
    TimedOut: (504, "timeout", "timeout"),
    ShuttingDown: (503, "server_error", "server_shutting_down"),
}


def failed(e: Exception) -> APIError:
    """What a request the engine refused or that failed while it ran answers: a refusal's status, else 500."""
    if type(e) in REFUSALS:
        status, kind, code = REFUSALS[type(e)]
        return APIError(status, str(e), code=code, kind=kind)
    return APIError(500, f"generation failed: {e}", kind="server_error")

"""OpenAI's error body: ``APIError`` (a status and OpenAI's ``{"error": {...}}``), and the shutdown error
every open request ends with on Ctrl-C."""

from __future__ import annotations

from typing import Optional

from fastapi.responses import JSONResponse

from gpt2lab.serve.engine import ShuttingDown


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

    def response(self) -> JSONResponse:
        return JSONResponse(status_code=self.status, content=error_body(self.message, self.kind, self.param, self.code))


def error_body(
    message: str, kind: str = "invalid_request_error", param: Optional[str] = None, code: Optional[str] = None
) -> dict:
    # a request's text may hold lone surrogates ("\ud800" in its JSON), which UTF-8 cannot encode:
    # they are shown escaped, so that the answer is still JSON
    message = message.encode("utf-8", "backslashreplace").decode("utf-8")
    return {"error": {"message": message, "type": kind, "param": param, "code": code}}


def shutting_down(e: ShuttingDown) -> APIError:
    return APIError(503, str(e), kind="server_error", code="server_shutting_down")

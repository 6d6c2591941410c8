"""The error a handler answers with: an HTTP status and the OpenAI error schema."""

ERROR_TYPES = {
    400: "BadRequestError",
    401: "AuthenticationError",
    404: "NotFoundError",
    503: "ServiceUnavailable",
}


class ApiError(Exception):
    """An error for the client: HTTP ``status``, the message, the request field it is about, and any HTTP
    ``headers`` to send with it (``Retry-After`` on a 503)."""

    def __init__(self, status: int, message: str, param: str | None = None, headers: dict | None = None):
        super().__init__(message)
        self.status = status
        self.param = param
        self.headers = headers

    def body(self) -> dict:
        """The OpenAI error schema."""
        kind = ERROR_TYPES.get(self.status, "APIError")
        return {"error": dict(message=str(self), type=kind, param=self.param, code=self.status)}

"""The one HTTP seam (:mod:`agentkv.http.transport`) and its deadline-bound reads (:mod:`agentkv.http.deadline`)."""

from agentkv.http.transport import (DEFAULT_MAX_ANSWER_BYTES, HttpAnswer, HttpError, HttpTransport, HttpxTransport,
                                    StartedPost, default_http, redact_url, unsendable_header)

__all__ = ["DEFAULT_MAX_ANSWER_BYTES", "HttpAnswer", "HttpError", "HttpTransport", "HttpxTransport", "StartedPost",
           "default_http", "redact_url", "unsendable_header"]

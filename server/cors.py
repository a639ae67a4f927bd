"""CORS for browser clients: ``--allowed-origins``, ``--allowed-methods``,
``--allowed-headers`` and ``--allow-credentials`` as vLLM names them, off by default.

Starlette's ``CORSMiddleware`` is added outermost, so a preflight (``OPTIONS`` with
``Access-Control-Request-Method``) is answered 200 with the allow headers before auth
runs, while the real request still needs the API key. Without allowed origins there is no
middleware: a preflight gets 405 and browsers refuse the cross-origin call.
"""

from __future__ import annotations

from fastapi import FastAPI
from fastapi.middleware.cors import CORSMiddleware

from server.settings import ServerSettings


def add_cors(app: FastAPI, settings: ServerSettings) -> None:
    """Install the CORS middleware when any origin is allowed."""
    if not settings.allowed_origins:
        return
    app.add_middleware(
        CORSMiddleware,
        allow_origins=list(settings.allowed_origins),
        allow_methods=list(settings.allowed_methods),
        allow_headers=list(settings.allowed_headers),
        allow_credentials=settings.allow_credentials,
    )

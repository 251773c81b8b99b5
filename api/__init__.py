"""rankscope's online service: the diagnosis API, automated slowdown tickets and the web page.

``rankscope serve`` runs :class:`~api.service.Service` (ingest, diagnose every running job, keep
tickets, notify webhooks) and serves :func:`~api.app.create_app` with uvicorn.
"""

from __future__ import annotations

from .app import create_app
from .service import ServeSettings, Service

__all__ = ["ServeSettings", "Service", "create_app"]

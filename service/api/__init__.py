"""The HTTP API: ``create_app(settings, evaluator=None)`` and its settings."""

from service.api.app import create_app
from service.api.settings import ServiceSettings

__all__ = ["ServiceSettings", "create_app"]

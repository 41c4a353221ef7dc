"""Typed keys for what the bridge's aiohttp application holds."""

from __future__ import annotations

import weakref
from collections import Counter

from aiohttp import web

from noria.frontend.bridge.gateway import Gateway
from noria.frontend.bridge.metrics import BridgeMetrics

GATEWAY = web.AppKey("gateway", Gateway)
METRICS = web.AppKey("metrics", BridgeMetrics)
API_KEY = web.AppKey("api_key", str)  # "" when no key is required
WEBSOCKETS = web.AppKey("websockets", weakref.WeakSet)  # open sockets, closed at shutdown
STARTED = web.AppKey("started", int)  # unix time the bridge started (OpenAI's `created` for models)
LIMIT = web.AppKey("limit", int)  # requests in flight per websocket or HTTP client address; 0: no cap
IN_FLIGHT = web.AppKey("in_flight", Counter)  # HTTP requests in flight per client address

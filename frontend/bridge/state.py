"""Typed keys for what the bridge's aiohttp application holds."""

from __future__ import annotations

import weakref

from aiohttp import web

from noria.frontend.bridge.gateway import Gateway
from noria.frontend.bridge.limits import BridgeLimits, ClientBudgets
from noria.frontend.bridge.metrics import BridgeMetrics

GATEWAY = web.AppKey("gateway", Gateway)
METRICS = web.AppKey("metrics", BridgeMetrics)
API_KEY = web.AppKey("api_key", str)  # "" when no key is required
WEBSOCKETS = web.AppKey("websockets", weakref.WeakSet)  # open sockets, closed at shutdown
STARTED = web.AppKey("started", int)  # unix time the bridge started (OpenAI's `created` for models)
BUDGETS = web.AppKey("budgets", ClientBudgets)  # sequences in flight per client address
LIMITS = web.AppKey("limits", BridgeLimits)  # the bridge's own caps and timeouts (its flags)
# --return-tokens-as-token-ids: logprob tokens as "token_id:ID" unless a request says otherwise
TOKEN_IDS = web.AppKey("return_tokens_as_token_ids", bool)

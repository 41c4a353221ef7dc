"""The bridge: HTTP + websocket server that is itself a client of the ZMQ API.

`noria bridge --engine tcp://HOST:PORT` runs it standalone; `noria serve`
starts it as a child process. It owns no engine state: every request goes
upstream through one `AsyncClient`, and the latency histograms are measured
here, from the deltas it relays.
"""

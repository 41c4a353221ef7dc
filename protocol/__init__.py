"""Every message that crosses a process boundary, and how it is encoded."""

PROTOCOL_VERSION = 1

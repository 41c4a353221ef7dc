"""Typed msgpack encoders/decoders, one pair per channel."""

from __future__ import annotations

from typing import Any, Generic, TypeVar

import msgspec

T = TypeVar("T")


class Codec(Generic[T]):
    """Encodes any message and decodes into the channel's union type `T`.

    The encoder reuses one buffer; `encode` returns a fresh bytes object, so
    the result may be queued for sending while the next message is encoded.
    """

    def __init__(self, union: Any) -> None:
        self._encoder = msgspec.msgpack.Encoder()
        self._decoder: msgspec.msgpack.Decoder[T] = msgspec.msgpack.Decoder(union)

    def encode(self, msg: Any) -> bytes:
        return self._encoder.encode(msg)

    def decode(self, data: bytes | memoryview) -> T:
        return self._decoder.decode(data)

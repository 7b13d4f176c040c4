"""Checksums of the side file's Arrow IPC messages: the writer seals each, the reader checks each.

Why: a reader of a damaged Arrow message trusts its lengths and offsets (a flipped bit in an offset
made pyarrow read outside the file and die by SIGSEGV) and its values (a flipped exponent bit read as
4.7e307 GiB). A CRC-32 of the whole message, frame, flatbuffer metadata and body together, catches
every single-bit flip, so a reader that checks it first never hands pyarrow a damaged message.

Where it lives: in the message's own custom metadata (a batch's, or the schema's), as the text
``crc32=XXXXXXXX`` (:data:`SEAL`). The CRC is taken over the message with those 8 hex digits as
``00000000``; :func:`seal` then writes them in place, which changes no length. Each message is framed
as Arrow's IPC stream format says (``0xFFFFFFFF``, int32 metadata length, flatbuffer ``Message``,
body); :func:`frame` reads that framing with every length bounded, without pyarrow.
"""

from __future__ import annotations

import struct
import zlib
from collections.abc import Callable

CHECKSUM_KEY = b"rankmem.checksum"
"""The custom-metadata key of a message's seal."""
SEAL = b"crc32="
PLACEHOLDER = SEAL + b"00000000"
"""What the writer puts under :data:`CHECKSUM_KEY` before sealing."""
HEADER_KEY = b"rankmem.header_crc32"
"""The schema's metadata: CRC-32 of the run log's header line, newline included (damage or a side file
of another run with the same world size then reads as a mismatch, not as this run's values)."""
_CONTINUATION = 0xFFFFFFFF
MAX_METADATA = 64 << 20
"""Most bytes one message's flatbuffer metadata may claim (the writer's are a few hundred)."""


def header_crc(line: bytes) -> str:
    return f"{zlib.crc32(line):08x}"


def seal(buf: bytearray, start: int, end: int) -> None:
    """Seal the message at ``buf[start:end]`` in place (its metadata holds :data:`PLACEHOLDER`)."""
    at = buf.rfind(PLACEHOLDER, start, end) + len(SEAL)
    assert at >= len(SEAL), "the message carries no checksum placeholder"
    buf[at : at + 8] = f"{zlib.crc32(memoryview(buf)[start:end]):08x}".encode()


def sealed(message: memoryview, metadata_end: int) -> bool | None:
    """True when the message's seal matches its bytes, False when it does not (or is not hex), None
    when the message has no seal (a side file written before seals)."""
    meta = bytes(message[:metadata_end])
    at = meta.rfind(SEAL)
    if at < 0:
        return None
    at += len(SEAL)
    digits = meta[at : at + 8]
    try:
        want = int(digits, 16) if len(digits) == 8 else -1
    except ValueError:
        return False
    crc = zlib.crc32(message[:at])
    crc = zlib.crc32(b"00000000", crc)
    crc = zlib.crc32(message[at + 8 :], crc)
    return crc == want


class Frame:
    """One IPC message's place in the file: where it starts, its metadata ends and it ends."""

    __slots__ = ("start", "metadata_end", "end")

    def __init__(self, start: int, metadata_end: int, end: int) -> None:
        self.start, self.metadata_end, self.end = start, metadata_end, end


def frame(read: Callable[[int, int], bytes | memoryview], at: int, size: int) -> Frame | str | None:
    """The message at byte ``at`` of a file of ``size`` bytes read by ``read(offset, count)``: a
    :class:`Frame`; None at the end-of-stream marker or the file's end; ``"truncated"`` when the file
    ends inside it; any other string says how it is damaged. Nothing is trusted: every length is
    bounded by the file before it is followed."""
    if at >= size:
        return None
    if at + 8 > size:
        return "truncated"
    marker, length = struct.unpack_from("<Ii", read(at, 8))
    if marker != _CONTINUATION:
        return f"no message starts at byte {at}"
    if length == 0:
        return None  # end of stream
    if length < 0 or length > MAX_METADATA or length % 8:
        return f"the message at byte {at} claims {length} bytes of metadata"
    if at + 8 + length > size:
        return "truncated"
    body = _body_length(memoryview(read(at + 8, length)))
    if body is None or body < 0 or body % 8:
        return f"the message at byte {at} has damaged metadata"
    end = at + 8 + length + body
    if end > size:
        return "truncated"
    return Frame(at, at + 8 + length, end)


def _body_length(meta: memoryview) -> int | None:
    """``Message.bodyLength`` (flatbuffer field 3) read with every offset checked; None when they point
    outside the metadata."""
    n = len(meta)
    if n < 8:
        return None
    (table,) = struct.unpack_from("<I", meta, 0)
    if table + 4 > n:
        return None
    (back,) = struct.unpack_from("<i", meta, table)
    vtable = table - back
    if vtable < 0 or vtable + 4 > n:
        return None
    (vsize,) = struct.unpack_from("<H", meta, vtable)
    if vsize < 12 or vtable + vsize > n:
        return 0 if 4 <= vsize < 12 and vtable + vsize <= n else None
    (field,) = struct.unpack_from("<H", meta, vtable + 10)
    if field == 0:
        return 0
    if table + field + 8 > n:
        return None
    (length,) = struct.unpack_from("<q", meta, table + field)
    return int(length)

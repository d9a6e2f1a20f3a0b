"""Opening checkpoint files safely: regular files only, bounded sizes, bounded JSON nesting.

Everything :mod:`fp8kv.checkpoint` reads from disk goes through here:

* Only regular files are opened. A path is ``os.stat``-ed first (which follows symlinks, so a
  Hugging Face hub snapshot, whose files are symlinks into ``blobs/``, is fine) and anything
  else -- a FIFO, a directory, a device, a socket -- is refused naming the path *without being
  opened* (opening a FIFO for reading blocks until a writer appears). The open itself uses
  ``O_NONBLOCK`` and re-checks with ``fstat``, so a file swapped for a FIFO in between cannot
  block either.
* JSON files are at most :data:`MAX_JSON_BYTES` and nest at most :data:`MAX_JSON_DEPTH`
  levels (checked on the text before parsing, so a hostile ``[[[[...`` never reaches the
  recursive decoder).
* A safetensors header (the JSON after the 8-byte length) is at most
  :data:`MAX_HEADER_BYTES` and must fit in the file.

No pickle is ever loaded: fp8kv reads ``*.json`` and ``*.safetensors`` headers and scale
tensors (through :mod:`safetensors`) only; ``*.bin`` / ``*.pt`` files are listed by name, never
opened.
"""

from __future__ import annotations

import json
import os
import re
import stat
from itertools import accumulate
from pathlib import Path
from typing import BinaryIO

from ..errors import InvalidArgument

MAX_JSON_BYTES = 16 * 2**20
"""Largest ``config.json`` / ``hf_quant_config.json`` read (16 MiB; real ones are a few KiB)."""

MAX_JSON_DEPTH = 64
"""Deepest JSON nesting accepted (real configs nest under 10 levels)."""

MAX_HEADER_BYTES = 64 * 2**20
"""Largest safetensors header read (64 MiB; a shard's header is typically under 1 MiB)."""

_ESCAPE = re.compile(r"\\.", re.S)
_STRING = re.compile(r'"[^"]*(?:"|\Z)')
_NOT_BRACKET = re.compile(r"[^\[\]{}]+")
_DELTA = {"[": 1, "{": 1, "]": -1, "}": -1}


def _kind(mode: int) -> str:
    for test, name in ((stat.S_ISDIR, "directory"), (stat.S_ISFIFO, "FIFO"), (stat.S_ISSOCK, "socket"),
                       (stat.S_ISCHR, "character device"), (stat.S_ISBLK, "block device")):
        if test(mode):
            return name
    return "special file"


def regular_file(path: Path, what: str) -> os.stat_result:
    """``os.stat`` of ``path`` (following symlinks), refusing anything but a regular file.

    Raises :class:`InvalidArgument` naming ``path`` for a missing file, a dangling symlink, a
    FIFO, a directory or another special file; the path is never opened.
    """
    try:
        st = os.stat(path)
    except FileNotFoundError:
        dangling = " (a dangling symlink)" if os.path.islink(path) else ""
        raise InvalidArgument(f"checkpoint: {path}: not found{dangling}, expected {what}") from None
    except (OSError, ValueError) as exc:  # ValueError: a NUL in the path
        raise InvalidArgument(f"checkpoint: {path!r}: cannot stat it ({exc}), expected {what}") from None
    if not stat.S_ISREG(st.st_mode):
        raise InvalidArgument(f"checkpoint: {path}: got a {_kind(st.st_mode)}, expected {what} "
                              "(a regular file, or a symlink to one); not opened")
    return st


def open_regular(path: Path, what: str) -> BinaryIO:
    """Open a regular file for binary reading, never blocking on a FIFO (see the module doc)."""
    regular_file(path, what)
    flags = os.O_RDONLY | getattr(os, "O_NONBLOCK", 0) | getattr(os, "O_NOCTTY", 0) | getattr(os, "O_BINARY", 0)
    try:
        fd = os.open(path, flags)
    except OSError as exc:
        raise InvalidArgument(f"checkpoint: {path}: cannot open it ({exc}), expected {what}") from None
    try:
        mode = os.fstat(fd).st_mode
        if not stat.S_ISREG(mode):
            raise InvalidArgument(f"checkpoint: {path}: got a {_kind(mode)}, expected {what} (a regular file)")
        return os.fdopen(fd, "rb")
    except BaseException:
        os.close(fd)
        raise


def json_depth(text: str) -> int:
    """How deep ``[``/``{`` nest in JSON ``text`` (brackets inside strings do not count)."""
    # Linear in len(text) whatever it holds: escapes go first (so strings hold no quotes), then
    # strings, an unterminated one running to the end; what is left outside strings is counted.
    brackets = _NOT_BRACKET.sub("", _STRING.sub("", _ESCAPE.sub("", text)))
    return max(accumulate(map(_DELTA.__getitem__, brackets)), default=0)


def parse_json(data: bytes, name: str):
    """Decode JSON ``data`` (UTF-8/16/32, as :func:`json.loads`), at most :data:`MAX_JSON_DEPTH` deep.

    ``name`` (a path, or ``"<file>: safetensors header"``) prefixes the error.
    """
    try:
        text = data.decode(json.detect_encoding(data))
    except UnicodeDecodeError as exc:
        raise InvalidArgument(f"checkpoint: {name}: cannot decode it as JSON text ({exc})") from None
    depth = json_depth(text)
    if depth > MAX_JSON_DEPTH:
        raise InvalidArgument(f"checkpoint: {name}: got JSON nested {depth} levels deep, expected at most "
                              f"{MAX_JSON_DEPTH}")
    try:
        return json.loads(text)
    except RecursionError:  # pragma: no cover - the depth check above comes first
        raise InvalidArgument(f"checkpoint: {name}: JSON nested too deeply, expected at most "
                              f"{MAX_JSON_DEPTH} levels") from None
    except ValueError as exc:
        raise InvalidArgument(f"checkpoint: {name}: cannot read it as JSON ({exc})") from None


def read_json(path: Path, what: str) -> dict:
    """The JSON object in regular file ``path`` (at most :data:`MAX_JSON_BYTES`)."""
    st = regular_file(path, what)
    if st.st_size > MAX_JSON_BYTES:
        raise InvalidArgument(f"checkpoint: {path}: got {st.st_size} bytes, expected {what} of at most "
                              f"{MAX_JSON_BYTES} bytes")
    with open_regular(path, what) as f:
        data = f.read(MAX_JSON_BYTES + 1)
    if len(data) > MAX_JSON_BYTES:
        raise InvalidArgument(f"checkpoint: {path}: more than {MAX_JSON_BYTES} bytes, expected {what} of at "
                              f"most {MAX_JSON_BYTES} bytes")
    obj = parse_json(data, str(path))
    if not isinstance(obj, dict):
        raise InvalidArgument(f"checkpoint: {path}: got a JSON {type(obj).__name__}, expected {what} "
                              "(a JSON object)")
    return obj


def safetensors_header(path: Path) -> dict:
    """The JSON header of safetensors file ``path`` (``name -> {dtype, shape, data_offsets}``).

    Reads the 8-byte little-endian header length and the header only; refuses a length over
    :data:`MAX_HEADER_BYTES` or past the end of the file, naming the file.
    """
    what = "a safetensors file"
    st = regular_file(path, what)
    with open_regular(path, what) as f:
        head = f.read(8)
        if len(head) < 8:
            raise InvalidArgument(f"checkpoint: {path}: got {len(head)} bytes, expected a safetensors file "
                                  "(an 8-byte header length, then the header)")
        n = int.from_bytes(head, "little")
        if n > MAX_HEADER_BYTES or 8 + n > st.st_size:
            bound = f"at most {MAX_HEADER_BYTES} bytes and within the file's {st.st_size} bytes"
            raise InvalidArgument(f"checkpoint: {path}: got a safetensors header length of {n} bytes, "
                                  f"expected {bound}")
        data = f.read(n)
    if len(data) < n:
        raise InvalidArgument(f"checkpoint: {path}: safetensors header truncated ({len(data)} of {n} bytes)")
    header = parse_json(data, f"{path}: safetensors header")
    if not isinstance(header, dict):
        raise InvalidArgument(f"checkpoint: {path}: got a safetensors header that is a JSON "
                              f"{type(header).__name__}, expected an object")
    return header

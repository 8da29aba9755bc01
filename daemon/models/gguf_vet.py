"""Vet a GGUF file's header before MLX reads it (no mlx import here).

MLX's GGUF reader (gguflib) trusts the header: a file claiming 2^60 tensors, a string of 2^62
bytes or a tensor with 2^31 dimensions crashes it (SIGSEGV / SIGABRT), which would take the
whole daemon down (docs/models.md: a broken model never does). `vet_gguf` walks every header
field with `struct` over the header's bytes (read, not mapped), bounding each count, length,
dimension, type, size and offset against caps and the file size before anything is
allocated, and raises `ModelLoadError` with one line naming what is wrong.

`check_gguf_loads` refuses a tensor type the converter cannot convert exactly (one line naming
the tensor and its type; `CONVERTIBLE`), then does the first read of a file with the `gguf`
package's reader (what `gguf_read` uses) in a child process, so a reader bug a vetted header
still hits kills the child, not the daemon; its verdict is cached by path, size, mtime and
inode, so a file is checked in a child once per process (and again once it changes). The
child maps the file and parses every field and tensor record, so the pre-load check
(`registry.check_model_files`, run before anything is evicted) only vets the header
(`vet_gguf_once`); the child read comes with the load itself (`gguf.read_gguf`), when a
failure there loads the evicted model back.

The layout follows the GGUF specification (ggml's docs/gguf.md): magic `GGUF`, uint32
version (2 or 3; version 1 used 32-bit counts), uint64 tensor count, uint64 key/value count,
the key/value pairs, the tensor infos (name, uint32 n_dims, uint64 dims, uint32 ggml type,
uint64 offset), then the tensor data from the next multiple of `general.alignment` (32).

`read_metadata` reads the values of a vetted file's metadata with the same bounded cursor (the
daemon's own GGUF reads go through it, not through the `gguf` package).

Why one module: the vetting and the metadata reader are one bounded walk of the same header
(`_Cursor`, the value types, the caps); split, each half would reach into the other's privates.
"""

from __future__ import annotations

import os
import signal
import struct
import subprocess
import sys
import threading
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from mlxcel.daemon.models.info import ModelLoadError

MAGIC = b"GGUF"
VERSIONS = (2, 3)
MAX_TENSORS = 65536
MAX_KV = 65536
MAX_DIMS = 4  # GGML_MAX_DIMS
MAX_KEY_BYTES = 65535  # the specification's limit on a key
MAX_NAME_BYTES = 256  # tensor names (llama.cpp allows 64)
MAX_STRING_BYTES = 64 << 20  # a metadata string (chat templates are a few KB)
MAX_ARRAY_ITEMS = 16 << 20  # a metadata array (a vocabulary is ~10^5 tokens)
MAX_ALIGNMENT = 1 << 16
DEFAULT_ALIGNMENT = 32
MAX_ELEMENTS = (1 << 63) - 1
CHILD_TIMEOUT_S = 600.0
FIRST_READ_BYTES = 8 << 20  # a 128k-token vocabulary and its merges fit

# ggml tensor types (ggml.h `enum ggml_type`): value -> (name, block elements, block bytes).
GGML_TYPES: dict[int, tuple[str, int, int]] = {
    0: ("F32", 1, 4),
    1: ("F16", 1, 2),
    2: ("Q4_0", 32, 18),
    3: ("Q4_1", 32, 20),
    6: ("Q5_0", 32, 22),
    7: ("Q5_1", 32, 24),
    8: ("Q8_0", 32, 34),
    9: ("Q8_1", 32, 40),
    10: ("Q2_K", 256, 84),
    11: ("Q3_K", 256, 110),
    12: ("Q4_K", 256, 144),
    13: ("Q5_K", 256, 176),
    14: ("Q6_K", 256, 210),
    15: ("Q8_K", 256, 292),
    16: ("IQ2_XXS", 256, 66),
    17: ("IQ2_XS", 256, 74),
    18: ("IQ3_XXS", 256, 98),
    19: ("IQ1_S", 256, 50),
    20: ("IQ4_NL", 32, 18),
    21: ("IQ3_S", 256, 110),
    22: ("IQ2_S", 256, 82),
    23: ("IQ4_XS", 256, 136),
    24: ("I8", 1, 1),
    25: ("I16", 1, 2),
    26: ("I32", 1, 4),
    27: ("I64", 1, 8),
    28: ("F64", 1, 8),
    29: ("IQ1_M", 256, 56),
    30: ("BF16", 1, 2),
    34: ("TQ1_0", 256, 54),
    35: ("TQ2_0", 256, 66),
    39: ("MXFP4", 32, 17),
}

# What gguf_read converts exactly (its module doc has the table); the rest is refused by name.
CONVERTIBLE = frozenset(
    {"F32", "F16", "BF16", "Q8_0", "Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q4_K", "Q5_K", "Q6_K"}
)

# Metadata value types: value -> (name, fixed size in bytes; 0 for string and array).
STRING, ARRAY, UINT32 = 8, 9, 4
VALUE_TYPES: dict[int, tuple[str, int]] = {
    0: ("uint8", 1),
    1: ("int8", 1),
    2: ("uint16", 2),
    3: ("int16", 2),
    4: ("uint32", 4),
    5: ("int32", 4),
    6: ("float32", 4),
    7: ("bool", 1),
    8: ("string", 0),
    9: ("array", 0),
    10: ("uint64", 8),
    11: ("int64", 8),
    12: ("float64", 8),
}


@dataclass(frozen=True)
class GGUFTensor:
    name: str
    shape: tuple[int, ...]  # GGUF order: ne0 (the fastest-varying) first
    ggml_type: str
    offset: int  # from the start of the data section
    nbytes: int


@dataclass(frozen=True)
class GGUFHeader:
    version: int
    kv_count: int
    alignment: int
    data_offset: int  # where the tensor data starts in the file
    file_size: int
    tensors: tuple[GGUFTensor, ...]


class _Bad(Exception):
    """One header field is wrong; the message says which."""


class _MoreBytes(Exception):
    """The header goes on past the bytes read so far: read `wanted` bytes and parse again."""

    def __init__(self, wanted: int) -> None:
        self.wanted = wanted


class _Cursor:
    """Bounded little-endian reads over the file's first bytes: every read checks the bytes
    left in the file (and asks for more of the file when the header goes on)."""

    def __init__(self, buf: bytes, size: int) -> None:
        self.buf, self.size, self.pos = buf, size, 0

    def need(self, n: int, what: str) -> None:
        if n > self.size - self.pos:
            raise _Bad(
                f"{what} needs {n} bytes at offset {self.pos}, past the end of the file "
                f"({self.size} bytes): truncated or corrupt"
            )
        if self.pos + n > len(self.buf):
            raise _MoreBytes(self.pos + n)

    def unpack(self, fmt: str, what: str) -> int:
        n = struct.calcsize(fmt)
        self.need(n, what)
        (value,) = struct.unpack_from(fmt, self.buf, self.pos)
        self.pos += n
        return int(value)

    def u32(self, what: str) -> int:
        return self.unpack("<I", what)

    def u64(self, what: str) -> int:
        return self.unpack("<Q", what)

    def skip_string(self, what: str, cap: int) -> None:
        length = self.u64(f"{what}'s length")
        if length > cap:
            raise _Bad(f"{what} claims {length} bytes (at most {cap})")
        self.need(length, what)
        self.pos += length

    def string(self, what: str, cap: int) -> str:
        start = self.pos
        self.skip_string(what, cap)
        raw = self.buf[start + 8 : self.pos]
        try:
            return raw.decode("utf-8")
        except UnicodeDecodeError:
            raise _Bad(f"{what} is not valid UTF-8") from None


def _value(cur: _Cursor, kind: int, key: str, in_array: bool = False) -> int | None:
    """Skip one metadata value of type `kind`; returns it when it is a uint32 (the alignment)."""
    if kind not in VALUE_TYPES:
        raise _Bad(f"metadata {key!r} has unknown value type {kind}")
    if kind == STRING:
        cur.skip_string(f"metadata {key!r} string", MAX_STRING_BYTES)
        return None
    if kind == ARRAY:
        if in_array:
            raise _Bad(f"metadata {key!r} is an array of arrays (not supported)")
        item = cur.u32(f"metadata {key!r} array type")
        count = cur.u64(f"metadata {key!r} array length")
        if count > MAX_ARRAY_ITEMS:
            raise _Bad(f"metadata {key!r} array claims {count} items (at most {MAX_ARRAY_ITEMS})")
        if item not in VALUE_TYPES:
            raise _Bad(f"metadata {key!r} array has unknown item type {item}")
        width = VALUE_TYPES[item][1]
        if width:
            cur.need(count * width, f"metadata {key!r} array")
            cur.pos += count * width
            return None
        cur.need(count * 8, f"metadata {key!r} array")  # each string or array: >= 8 bytes
        if item == STRING:
            _skip_strings(cur, count, key)
            return None
        for _ in range(count):
            _value(cur, item, key, in_array=True)
        return None
    width = VALUE_TYPES[kind][1]
    if kind == UINT32:
        return cur.u32(f"metadata {key!r}")
    cur.need(width, f"metadata {key!r}")
    cur.pos += width
    return None


_U64 = struct.Struct("<Q")


def _skip_strings(cur: _Cursor, count: int, key: str) -> None:
    """`count` strings of an array (a vocabulary: ~10^5) in one tight loop; the first one
    that does not fit goes through `skip_string`, which says what is wrong (or asks for more
    of the file)."""
    buf, pos, unpack = cur.buf, cur.pos, _U64.unpack_from
    limit = min(len(buf), cur.size)
    done = 0
    while done < count:
        if pos + 8 > limit:
            break
        (length,) = unpack(buf, pos)
        if length > MAX_STRING_BYTES or pos + 8 + length > limit:
            break
        pos += 8 + length
        done += 1
    cur.pos = pos
    for _ in range(count - done):
        cur.skip_string(f"metadata {key!r} string", MAX_STRING_BYTES)


def _tensor_info(cur: _Cursor, index: int) -> tuple[str, tuple[int, ...], int, int]:
    name = cur.string(f"tensor {index}'s name", MAX_NAME_BYTES)
    n_dims = cur.u32(f"tensor {name!r} n_dims")
    if not 1 <= n_dims <= MAX_DIMS:
        raise _Bad(f"tensor {name!r} claims {n_dims} dimensions (1 to {MAX_DIMS})")
    shape = tuple(cur.u64(f"tensor {name!r} dimension") for _ in range(n_dims))
    for dim in shape:
        if dim == 0 or dim > MAX_ELEMENTS:
            raise _Bad(f"tensor {name!r} has dimension {dim} (shape {list(shape)})")
    kind = cur.u32(f"tensor {name!r} type")
    offset = cur.u64(f"tensor {name!r} offset")
    return name, shape, kind, offset


def _tensor(
    name: str, shape: tuple[int, ...], kind: int, offset: int, align: int, room: int
) -> GGUFTensor:
    if kind not in GGML_TYPES:
        raise _Bad(f"tensor {name!r} has unknown ggml type {kind}")
    type_name, block, block_bytes = GGML_TYPES[kind]
    elements = 1
    for dim in shape:
        elements *= dim
    if elements > MAX_ELEMENTS:
        raise _Bad(f"tensor {name!r} shape {list(shape)} overflows ({elements} elements)")
    if shape[0] % block:
        raise _Bad(f"tensor {name!r} ({type_name}) row of {shape[0]} is not a multiple of {block}")
    nbytes = elements // block * block_bytes
    if offset % align:
        raise _Bad(f"tensor {name!r} offset {offset} is not a multiple of the alignment {align}")
    if offset > room or nbytes > room - offset:
        raise _Bad(
            f"tensor {name!r} ({nbytes} bytes at data offset {offset}) extends past the end of "
            f"the file ({room} data bytes): truncated or corrupt"
        )
    return GGUFTensor(name, shape, type_name, offset, nbytes)


def _parse(buf: bytes, size: int) -> GGUFHeader:
    cur = _Cursor(buf, size)
    cur.need(24, "the header")
    if buf[:4] != MAGIC:
        raise _Bad(f"not a GGUF file (magic {buf[:4]!r}, expected {MAGIC!r})")
    cur.pos = 4
    version = cur.u32("the version")
    if version not in VERSIONS:
        raise _Bad(f"unsupported GGUF version {version} (only {' and '.join(map(str, VERSIONS))})")
    n_tensors = cur.u64("the tensor count")
    n_kv = cur.u64("the metadata count")
    if n_tensors > MAX_TENSORS:
        raise _Bad(f"header claims {n_tensors} tensors (at most {MAX_TENSORS})")
    if n_kv > MAX_KV:
        raise _Bad(f"header claims {n_kv} metadata entries (at most {MAX_KV})")
    align = DEFAULT_ALIGNMENT
    keys: set[str] = set()
    for index in range(n_kv):
        key = cur.string(f"metadata key {index}", MAX_KEY_BYTES)
        if key in keys:
            raise _Bad(f"metadata key {key!r} appears twice")
        keys.add(key)
        kind = cur.u32(f"metadata {key!r} type")
        value = _value(cur, kind, key)
        if key == "general.alignment":
            if kind != UINT32 or value is None:
                raise _Bad("general.alignment is not a uint32")
            if value == 0 or value & (value - 1) or value > MAX_ALIGNMENT:
                raise _Bad(f"general.alignment {value} is not a power of two up to {MAX_ALIGNMENT}")
            align = value
    infos = []
    names: set[str] = set()
    for index in range(n_tensors):
        info = _tensor_info(cur, index)
        if info[0] in names:
            raise _Bad(f"tensor {info[0]!r} appears twice")
        names.add(info[0])
        infos.append(info)
    data_offset = cur.pos + (-cur.pos % align)
    room = max(size - data_offset, 0)
    tensors = [_tensor(*info, align, room) for info in infos]
    end = 0
    for tensor in sorted(tensors, key=lambda t: t.offset):
        if tensor.offset < end:
            raise _Bad(f"tensor {tensor.name!r} at data offset {tensor.offset} overlaps another")
        end = tensor.offset + tensor.nbytes
    return GGUFHeader(version, n_kv, align, data_offset, size, tuple(tensors))


def vet_gguf(path: Path) -> GGUFHeader:
    """The bounded header of GGUF file `path`; `ModelLoadError` (one line) when any field is
    out of bounds or inconsistent with the file size. Reads only the header: its first 8 MiB,
    more (doubling) while the header goes on; no memory map, so a file cut short meanwhile
    cannot SIGBUS the process."""
    path = Path(path)
    try:
        with open(path, "rb") as f:
            size = os.fstat(f.fileno()).st_size
            if size < 24:
                raise ModelLoadError(
                    f"{path.name}: not a GGUF file ({size} bytes, a header needs 24)"
                )
            buf = f.read(min(size, FIRST_READ_BYTES))
            while True:
                try:
                    return _parse(buf, size)
                except _MoreBytes as more:
                    want = min(size, max(more.wanted, 2 * len(buf)))
                    buf += f.read(want - len(buf))
                    if len(buf) < more.wanted:
                        raise _Bad("the file shrank while it was read") from None
    except _Bad as exc:
        raise ModelLoadError(f"{path.name}: {exc}") from None
    except (OSError, ValueError) as exc:
        raise ModelLoadError(f"cannot read GGUF file {path}: {exc}") from None


# --- the metadata's values, of a vetted file -------------------------------------------------

# struct formats of the fixed-size value types (VALUE_TYPES' keys but string and array)
_SCALAR_FORMATS = {0: "B", 1: "b", 2: "H", 3: "h", 4: "I", 5: "i", 6: "f", 7: "?", 10: "Q",
                   11: "q", 12: "d"}  # fmt: skip


def read_metadata(path: Path, header: GGUFHeader) -> dict[str, Any]:
    """Every metadata key's value of a file `vet_gguf` passed, as plain Python (str, int, float,
    bool, or a list of them), walked with `struct` over the header's bytes like the vetting; a
    string that is not UTF-8, or a file changed since its vetting, is `ModelLoadError`. This
    is what `gguf_read` serves from (~0.04 s for a 49k-token vocabulary, where the `gguf`
    package's reader builds a numpy view per item: 4.7 s)."""
    path = Path(path)
    try:
        with open(path, "rb") as f:
            buf = f.read(header.data_offset)
        cur = _Cursor(buf, len(buf))
        cur.need(24, "the header")
        cur.pos = 24  # magic, version, the two counts (vetted)
        out: dict[str, Any] = {}
        for index in range(header.kv_count):
            key = cur.string(f"metadata key {index}", MAX_KEY_BYTES)
            out[key] = _read_value(cur, cur.u32(f"metadata {key!r} type"), key)
        return out
    except (_Bad, _MoreBytes) as exc:
        raise ModelLoadError(f"{path.name}: {exc} (changed since it was checked?)") from None
    except (OSError, ValueError) as exc:
        raise ModelLoadError(f"cannot read GGUF file {path}: {exc}") from None


def _read_value(cur: _Cursor, kind: int, key: str) -> Any:
    if kind == STRING:
        return cur.string(f"metadata {key!r} string", MAX_STRING_BYTES)
    if kind == ARRAY:
        item = cur.u32(f"metadata {key!r} array type")
        count = cur.u64(f"metadata {key!r} array length")
        if count > MAX_ARRAY_ITEMS:
            raise _Bad(f"metadata {key!r} array claims {count} items (at most {MAX_ARRAY_ITEMS})")
        if item == STRING:
            return _read_strings(cur, count, key)
        if item not in _SCALAR_FORMATS:
            raise _Bad(f"metadata {key!r} array has item type {item}")
        fmt = f"<{count}{_SCALAR_FORMATS[item]}"
        cur.need(struct.calcsize(fmt), f"metadata {key!r} array")
        values = list(struct.unpack_from(fmt, cur.buf, cur.pos))
        cur.pos += struct.calcsize(fmt)
        return values
    if kind not in _SCALAR_FORMATS:
        raise _Bad(f"metadata {key!r} has unknown value type {kind}")
    fmt = "<" + _SCALAR_FORMATS[kind]
    cur.need(struct.calcsize(fmt), f"metadata {key!r}")
    (value,) = struct.unpack_from(fmt, cur.buf, cur.pos)
    cur.pos += struct.calcsize(fmt)
    return value


def _read_strings(cur: _Cursor, count: int, key: str) -> list[str]:
    """`count` strings of an array (a vocabulary) in one tight loop, each bounded like
    `_Cursor.string`."""
    buf, pos, unpack, end = cur.buf, cur.pos, _U64.unpack_from, len(cur.buf)
    out = []
    for _ in range(count):
        if pos + 8 > end:
            raise _Bad(f"metadata {key!r} string runs past the header")
        (length,) = unpack(buf, pos)
        pos += 8
        if length > MAX_STRING_BYTES or pos + length > end:
            raise _Bad(f"metadata {key!r} string of {length} bytes runs past the header")
        try:
            out.append(buf[pos : pos + length].decode("utf-8"))
        except UnicodeDecodeError:
            raise _Bad(f"metadata {key!r} string is not valid UTF-8") from None
        pos += length
    cur.pos = pos
    return out


# --- the first read, in a child process ---------------------------------------------------

_CHILD = (
    "import sys; from gguf import GGUFReader; r = GGUFReader(sys.argv[1], 'r'); "
    "[f.contents() for f in r.fields.values()]; [t.data.shape for t in r.tensors]"
)
_verdicts: dict[tuple[str, int, int, int], tuple[str | None, GGUFHeader]] = {}
_vetted: dict[tuple[str, int, int, int], GGUFHeader] = {}
_verdicts_lock = threading.Lock()
MAX_REMEMBERED = 1024  # file versions; then forgotten (checked again)


def _file_key(path: Path) -> tuple[str, int, int, int]:
    st = path.stat()
    return (str(path.resolve()), st.st_size, st.st_mtime_ns, st.st_ino)


def _signal_name(number: int) -> str:
    try:
        return signal.Signals(number).name
    except ValueError:
        return f"signal {number}"


def _child_verdict(path: Path) -> tuple[str | None, bool]:
    """(None when a child process could read the file, else the one-line reason;
    whether that verdict is the file's, to cache, rather than a passing failure)."""
    try:
        proc = subprocess.run(
            [sys.executable, "-c", _CHILD, str(path)],
            stdin=subprocess.DEVNULL,
            capture_output=True,
            text=True,
            errors="replace",
            timeout=CHILD_TIMEOUT_S,
            check=False,
        )
    except subprocess.TimeoutExpired:
        return f"reading it took over {CHILD_TIMEOUT_S:.0f} s in a check process", False
    except OSError as exc:
        return f"cannot start the check process ({exc})", False
    if proc.returncode == 0:
        return None, True
    if proc.returncode < 0:
        number = -proc.returncode
        if number == signal.SIGKILL:  # the OOM killer, or someone: not the file's doing
            return "the check process was killed (SIGKILL; out of memory?)", False
        return f"the file crashed the GGUF reader (signal {number}, {_signal_name(number)})", True
    lines = [line.strip() for line in proc.stderr.splitlines() if line.strip()]
    last = lines[-1] if lines else f"exit status {proc.returncode}"
    for prefix in ("RuntimeError: ", "ValueError: ", "IndexError: ", "KeyError: "):
        last = last.removeprefix(prefix)
    return last, True


def unconvertible_reason(name: str, type_name: str) -> str:
    return (
        f"GGUF tensor {name!r} has type {type_name}, which mlxcel cannot convert exactly "
        f"(supported: {', '.join(sorted(CONVERTIBLE))})"
    )


def check_convertible(header: GGUFHeader) -> None:
    """`ModelLoadError` naming the first tensor whose type is not in `CONVERTIBLE`."""
    for tensor in header.tensors:
        if tensor.ggml_type not in CONVERTIBLE:
            raise ModelLoadError(unconvertible_reason(tensor.name, tensor.ggml_type))


def vet_gguf_once(path: Path) -> GGUFHeader:
    """`vet_gguf`, remembered per file version (path, size, mtime, inode) in this process; a
    file whose child read already failed is refused with that reason."""
    path = Path(path)
    try:
        key = _file_key(path)
    except OSError as exc:
        raise ModelLoadError(f"cannot read GGUF file {path}: {exc}") from None
    with _verdicts_lock:
        cached = _verdicts.get(key)
        header = _vetted.get(key)
    if cached is not None:
        verdict, header = cached
        if verdict is not None:
            raise ModelLoadError(f"cannot read GGUF file {path}: {verdict}")
    if header is None:
        header = vet_gguf(path)
        with _verdicts_lock:
            if len(_vetted) >= MAX_REMEMBERED:
                _vetted.clear()
            _vetted[key] = header
    return header


def check_gguf_loads(path: Path) -> GGUFHeader:
    """Vet `path` and its tensor types, then (once per file version and process) read it in a
    child process; `ModelLoadError` when any fails, so a file that would crash the reader
    never reaches the caller's own read. A file already checked (same path, size, mtime,
    inode) is not read again."""
    path = Path(path)
    try:
        key = _file_key(path)
    except OSError as exc:
        raise ModelLoadError(f"cannot read GGUF file {path}: {exc}") from None
    with _verdicts_lock:
        cached = _verdicts.get(key)
    if cached is None:
        header = vet_gguf_once(path)
        check_convertible(header)
        verdict, cacheable = _child_verdict(path)
        if cacheable:
            with _verdicts_lock:
                if len(_verdicts) >= MAX_REMEMBERED:
                    _verdicts.clear()
                _verdicts[key] = (verdict, header)
    else:
        verdict, header = cached
    if verdict is not None:
        raise ModelLoadError(f"cannot read GGUF file {path}: {verdict}")
    return header

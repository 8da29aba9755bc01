"""The prompt cache's disk tier (docs/internals.md; integrity rules: docs/reliability.md,
"The prompt cache on disk"; sizing: docs/tuning.md).

NOTE on the design
    An entry is one chunk: the KV of CHUNK_TOKENS tokens, every layer. Chunk i of a token
    sequence is named by a chain key, k_0 = sha256(fingerprint), k_i = sha256(k_(i-1) ||
    tokens of chunk i as int32), so one key names one model (the fingerprint: weights, dtype,
    KV layout, kernel path, this format) and one exact token prefix. A prompt's disk match is
    the longest run of its chunk keys present from its start, at most all tokens but the last
    (as in the RAM tier). A longer sequence that extends a cached one writes only its new
    chunks; a chain is touched deepest first, so the LRU evicts a chain from its end.
    File: <dir>/<fingerprint[:16]>/<key[:2]>/<key>.kv = MAGIC, u32 header length, the JSON
    header (format, fingerprint, key, parent key, chunk index, tokens, layer shapes, dtype,
    data length, CRC-32 of the data), then the data (each layer's keys then values for the
    chunk's tokens). A chunk is written to a temporary name and renamed into place, so a
    `kill -9` leaves a temporary file (deleted at the next start), never a half entry. A read
    checks the header against the expected key (fingerprint, parent and tokens must hash to
    it), the shapes, the length and the CRC; a file that fails is deleted, logged and counted,
    and the match ends before it (the request prefills the rest).
    Threads: the engine thread calls `match`, `offer` (which evaluates the payload there:
    mlx has no stream on the writer thread, and an evaluated array's bytes never change),
    `start_read`, `take_reads` and `stats`, none of which touches the disk. One writer
    thread writes (and scans at start, evicts, clears); one reader thread reads, building the
    layers' arrays off the engine thread. The index (key -> bytes and last use, in LRU
    order) and the counters are shared under a lock. Each write job and each read stamps
    its chain's files' times (the first chunk newest), so the LRU order survives a restart.
    Files of other fingerprints (other models, older versions) count in the byte budget and
    go first; the live tiers of one process on one folder (several resident models) keep
    one budget together, the least recently used chunk of any going next (`_Root`).
    A `clear` (reset) bumps a generation: queued writes, pending keys and reads in flight of
    before are dropped. A failing disk (full, read-only) is logged once until a write works.

Why one module: the disk tier's invariants (chain keys, the entry format, the atomic write, the
checked read, eviction's byte accounting) hold across its writer thread, its reader and its
index together; the design note above is the one place that states them.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import logging
import os
import queue
import shutil
import struct
import threading
import time
import weakref
import zlib
from collections import OrderedDict, deque
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import numpy as np

log = logging.getLogger("mlxcel.engine.disk")

FORMAT_VERSION = 1
MAGIC = b"MLXCELKV"
CHUNK_TOKENS = 64  # tokens per disk entry: two KV blocks
SUFFIX = ".kv"
MODEL_FILE = "model.json"  # in each model's folder: which model wrote it
TMP_SUFFIX = ".tmp"
MAX_HEADER_BYTES = 1 << 20
PENDING_WAIT_S = 10.0  # a read waits this long at most for a chunk still being written
# KV waiting for the writer: more is dropped (counted), never waited for
MAX_PENDING_BYTES = 512 << 20
# the default byte budget: this share of the free disk, at most DEFAULT_CAP_BYTES
DEFAULT_SHARE = 0.25
DEFAULT_CAP_BYTES = 32 << 30

_HEAD = struct.Struct("<8sI")
# the dtypes a chunk may hold, and how numpy carries their bytes
_NP_DTYPES = {"float32": np.float32, "float16": np.float16, "bfloat16": np.uint16}


def default_disk_bytes(directory: Path) -> int:
    """DEFAULT_SHARE of the space where the tier lives (free, plus what the tier's folder
    holds already: else each start would allow less than the last and evict), at most
    DEFAULT_CAP_BYTES."""
    probe = directory
    while not probe.exists() and probe != probe.parent:
        probe = probe.parent
    try:
        st = os.statvfs(probe)
    except OSError:
        return 0
    return int(
        min(
            (st.f_bavail * st.f_frsize + _folder_bytes(directory)) * DEFAULT_SHARE,
            DEFAULT_CAP_BYTES,
        )
    )


def _folder_bytes(directory: Path) -> int:
    """The disk the files under `directory` take (allocated blocks, as free space counts)."""
    total = 0
    for base, _, names in os.walk(directory):
        for name in names:
            with contextlib.suppress(OSError):
                st = os.lstat(os.path.join(base, name))
                total += st.st_blocks * 512 if hasattr(st, "st_blocks") else st.st_size
    return total


IDENTITY_EDGE_BYTES = 1 << 20  # hashed at each end of a weight file
IDENTITY_SAMPLES = 32  # windows hashed between them, evenly spread
IDENTITY_SAMPLE_BYTES = 64 << 10


def weights_identity(path: str | Path) -> str:
    """What names a model's weights without reading them all: for each weight file (a
    .gguf, or a folder's *.safetensors), its name, size, modification time (ns), the blob it
    links to (a Hugging Face cache names blobs by their hash) and the SHA-256 of its first and
    last MiB and of IDENTITY_SAMPLES windows between them (a small file: all of it). A pulled
    update, another quantization, another model or a fine-tune written over a copy (a fused
    LoRA keeps the size and both ends) differ; the same files give the same identity in every
    process."""
    root = Path(path)
    files = (
        [root]
        if root.is_file()
        else sorted(root.glob("*.safetensors")) + sorted(root.glob("*.gguf"))
    )
    if not files:  # config.json alone names no weights (every fine-tune shares it)
        raise ValueError(f"no weight files (*.safetensors, *.gguf) to identify in {root}")
    digest = hashlib.sha256()
    for file in files:
        st = file.stat()
        size = st.st_size
        blob = Path(os.path.realpath(file)).name if file.is_symlink() else ""
        digest.update(f"{file.name}\0{size}\0{st.st_mtime_ns}\0{blob}\0".encode())
        with open(file, "rb") as f:
            if size <= 2 * IDENTITY_EDGE_BYTES + IDENTITY_SAMPLES * IDENTITY_SAMPLE_BYTES:
                digest.update(f.read())
                continue
            digest.update(f.read(IDENTITY_EDGE_BYTES))
            inner = size - 2 * IDENTITY_EDGE_BYTES - IDENTITY_SAMPLE_BYTES
            for i in range(IDENTITY_SAMPLES):
                f.seek(IDENTITY_EDGE_BYTES + inner * i // max(IDENTITY_SAMPLES - 1, 1))
                digest.update(f.read(IDENTITY_SAMPLE_BYTES))
            f.seek(size - IDENTITY_EDGE_BYTES)
            digest.update(f.read(IDENTITY_EDGE_BYTES))
    for name in ("config.json", "tokenizer.json"):
        extra = root / name if root.is_dir() else None
        if extra is not None and extra.is_file():
            digest.update(extra.read_bytes())
    return digest.hexdigest()


def make_fingerprint(weights: str, dtype: str, kv_layout: str, kernel_path: str) -> str:
    text = json.dumps(
        {
            "format": FORMAT_VERSION,
            "weights": weights,
            "dtype": dtype,
            "kv_layout": kv_layout,
            "kernel_path": kernel_path,
        },
        sort_keys=True,
    )
    return hashlib.sha256(text.encode()).hexdigest()


def open_tier(cfg: Any, model_path: str, dtype: str, model: Any, runner: Any) -> DiskTier | None:
    """The disk tier for one loaded model, or None when it is off (`prompt_cache_disk_bytes`
    0, no folder) or cannot be made (said in the log; the RAM tier works alone)."""
    capacity = getattr(cfg, "prompt_cache_disk_bytes", None)
    directory = getattr(cfg, "prompt_cache_dir", None)
    if capacity == 0 or not directory:
        return None
    from mlxcel.daemon.engine.mlx_support import kernel_path, kv_layout

    root = Path(directory).expanduser()
    try:
        root.mkdir(parents=True, exist_ok=True, mode=0o700)
        if capacity is None:
            capacity = default_disk_bytes(root)
        fingerprint = make_fingerprint(
            weights_identity(model_path), dtype, kv_layout(model), kernel_path(runner)
        )
    except Exception as exc:  # an odd model or folder: serve without the tier
        log.warning("prompt cache disk tier off: %s", exc)
        return None
    if capacity <= 0:
        log.warning("prompt cache disk tier off: no free disk at %s", root)
        return None
    log.info(
        "prompt cache disk tier: %s, %.1f GiB, fingerprint %s",
        root,
        capacity / 2**30,
        fingerprint[:16],
    )
    tier = DiskTier(root, fingerprint, capacity)
    tier.describe(model_path)
    return tier


def forget_model(root: str | Path, model_path: str | Path) -> list[Path]:
    """Delete the disk-tier folders of the model at `model_path` (or below it: a store
    entry's folder holds its weights): `models rm` calls this. Returns what was deleted."""
    removed = []
    target = Path(model_path).resolve()
    base = Path(root).expanduser()
    for sub in base.iterdir() if base.is_dir() else ():
        try:
            meta = json.loads((sub / MODEL_FILE).read_text(encoding="utf-8"))
            path = Path(str(meta["model_path"])).resolve()
        except (OSError, ValueError, KeyError, TypeError):
            continue
        if path == target or target in path.parents:
            shutil.rmtree(sub, ignore_errors=True)
            removed.append(sub)
    return removed


def _chunk_bytes(tokens: Sequence[int]) -> bytes:
    return np.asarray(tokens, dtype="<i4").tobytes()


def chain_keys(root: bytes, tokens: Sequence[int], num_chunks: int) -> list[bytes]:
    keys, parent = [], root
    for i in range(num_chunks):
        chunk = tokens[i * CHUNK_TOKENS : (i + 1) * CHUNK_TOKENS]
        parent = hashlib.sha256(parent + _chunk_bytes(chunk)).digest()
        keys.append(parent)
    return keys


@dataclass
class DiskStats:
    lookups: int = 0
    hits: int = 0
    misses: int = 0
    hit_tokens: int = 0
    bytes_read: int = 0
    bytes_written: int = 0
    read_seconds: float = 0.0
    write_seconds: float = 0.0
    reads: int = 0
    writes: int = 0  # chunks written
    evictions: int = 0  # chunks deleted for the byte budget
    rejected: int = 0  # files found corrupt, truncated or foreign: deleted, never served
    writes_dropped: int = 0  # offers dropped because the writer was too far behind
    write_errors: int = 0  # write jobs the disk refused (full, read-only): logged once


@dataclass
class DiskRead:
    """A finished read: the first `num_tokens` of the prompt, as per-layer arrays (None when
    nothing could be read)."""

    tag: Any
    tokens: tuple[int, ...]
    num_tokens: int
    layers: list[tuple[Any, Any]] | None
    dtype: str
    seconds: float
    generation: int = 0  # the tier's at `start_read`: a reset since drops the read


@dataclass
class _Write:
    tokens: tuple[int, ...]
    keys: list[bytes]
    first: int  # the first chunk to write
    layers: list[tuple[Any, Any]]
    nbytes: int
    generation: int


class _Root:
    """What the live tiers on one folder share (one process; e.g. `max_loaded_models` > 1):
    the files of no live tier (other fingerprints: models not loaded, older versions), oldest
    first, and the tiers, so that together they keep one byte budget (`_evict_to_fit`)."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.tiers: weakref.WeakSet[DiskTier] = weakref.WeakSet()
        self.foreign: deque[tuple[Path, int]] = deque()
        self.foreign_bytes = 0

    def live(self) -> list[DiskTier]:
        with self.lock:
            return list(self.tiers)


_ROOTS_LOCK = threading.Lock()
_ROOTS: dict[str, _Root] = {}


def _root_of(directory: Path) -> _Root:
    name = str(Path(directory).resolve())
    with _ROOTS_LOCK:
        return _ROOTS.setdefault(name, _Root())


class DiskTier:
    """One model's view of the disk tier (docs/internals.md, "The disk tier")."""

    def __init__(
        self,
        directory: str | Path,
        fingerprint: str,
        capacity_bytes: int,
        *,
        label: str = "",
        write_delay_s: float = 0.0,
    ) -> None:
        self.root = Path(directory)
        self.fingerprint = fingerprint
        self.dir = self.root / fingerprint[:16]
        self.capacity_bytes = capacity_bytes
        self.label = label
        self.stats = DiskStats()
        self.write_delay_s = write_delay_s  # tests: a slow disk
        self.on_read_done: Callable[[], None] = lambda: None
        self._root_key = hashlib.sha256(fingerprint.encode()).digest()
        self._lock = threading.Lock()
        # a queued chunk was written (or given up): a read waiting for it goes on
        self._landed = threading.Condition(self._lock)
        # key -> (bytes, last use in ns: the file's mtime), least recently used first
        self._index: OrderedDict[bytes, tuple[int, int]] = OrderedDict()
        self._pending: dict[bytes, int] = {}  # keys queued for the writer -> their generation
        self._pending_bytes = 0
        self._shared = _root_of(self.root)  # the other tiers on this folder, their files
        self._generation = 0  # bumped by clear: queued writes and reads of before are dropped
        self._write_failing = False  # the disk refused a write: said once, until one works
        self._done: deque[DiskRead] = deque()
        self.ready = False  # the start scan has run: before it, nothing matches
        self.num_bytes = 0
        self._writes: queue.Queue[Any] = queue.Queue()
        self._reads: queue.Queue[Any] = queue.Queue()
        self._closed = False
        with self._shared.lock:
            self._shared.tiers.add(self)
        self._writer = threading.Thread(
            target=self._write_loop, name="mlxcel-kv-writer", daemon=True
        )
        self._reader = threading.Thread(
            target=self._read_loop, name="mlxcel-kv-reader", daemon=True
        )
        self._writer.start()
        self._reader.start()
        self._writes.put(("scan",))

    # -- engine thread ---------------------------------------------------------------------

    @property
    def num_entries(self) -> int:
        return len(self._index)

    def match(self, tokens: Sequence[int]) -> tuple[int, list[bytes]]:
        """(tokens, keys) of the longest run of this prompt's chunks on disk from its start,
        at most all tokens but the last; counted in the stats."""
        limit = (len(tokens) - 1) // CHUNK_TOKENS
        found: list[bytes] = []
        keys = chain_keys(self._root_key, tokens, limit) if self.ready and limit > 0 else []
        with self._lock:  # the counters too: the reader thread bumps them as well
            for key in keys:
                # a chunk still queued for the writer counts: the read waits for it (the
                # next turn of a conversation often comes before its last turn is written)
                if key not in self._index and key not in self._pending:
                    break
                found.append(key)
            self.stats.lookups += 1
            if not found:
                self.stats.misses += 1
        return len(found) * CHUNK_TOKENS, found

    def start_read(self, tag: Any, tokens: Sequence[int], keys: list[bytes]) -> None:
        """Read these chunks on the reader thread; the result comes from `take_reads`."""
        with self._lock:
            generation = self._generation
        self._reads.put((tag, tuple(tokens[: len(keys) * CHUNK_TOKENS]), keys, generation))

    def payload(self, read: DiskRead) -> Any:
        """A finished read's layers as the prompt cache's payload (engine thread: bfloat16
        travels as uint16 and is viewed back here, on the thread that will evaluate it)."""
        import mlx.core as mx
        from mlxcel.daemon.engine.mlx_support import KVPayload

        layers = read.layers or []
        if read.dtype == "bfloat16":
            layers = [(k.view(mx.bfloat16), v.view(mx.bfloat16)) for k, v in layers]
        return KVPayload(layers)

    @property
    def has_reads(self) -> bool:
        """A finished read waits for `take_reads` (any thread)."""
        return bool(self._done)

    def take_reads(self) -> list[DiskRead]:
        """The finished reads; one started before a `clear` (a reset) comes back empty, so
        the request is prefilled as the reset asked."""
        out = []
        while self._done:
            read = self._done.popleft()
            with self._lock:
                stale = read.generation != self._generation
            if stale and read.layers is not None:
                read = DiskRead(read.tag, (), 0, None, "", read.seconds, read.generation)
            out.append(read)
        return out

    def offer(self, tokens: Sequence[int], layers: list[tuple[Any, Any]]) -> None:
        """Write the chunks of `tokens` not on disk yet, from `layers` (per-layer evaluated,
        contiguous (1, heads, n, dim) keys and values for at least those tokens). Never waits:
        when the chunks to write would take the queued ones over MAX_PENDING_BYTES, the
        offer is dropped and counted (an offer to an idle writer always goes)."""
        num = len(tokens) // CHUNK_TOKENS
        if num == 0 or self._closed or self.capacity_bytes <= 0:
            return
        _evaluate(layers)  # here, on the engine thread: the writer only reads their bytes
        keys = chain_keys(self._root_key, tokens, num)
        with self._lock:
            generation = self._generation
            first = next(
                (
                    i
                    for i, k in enumerate(keys)
                    if k not in self._index and self._pending.get(k) != generation
                ),
                None,
            )
            if first is None:
                return
            # the bytes to write (a grown chain's new chunks), not the whole payload: a long
            # prompt's KV is over the bound (512 MiB: 4k tokens of an 8B model); with the
            # writer idle any one offer goes, so every prompt can reach the disk
            whole = sum(k.nbytes + v.nbytes for k, v in layers)
            nbytes = whole * (num - first) * CHUNK_TOKENS // max(len(tokens), 1)
            if self._pending_bytes and self._pending_bytes + nbytes > MAX_PENDING_BYTES:
                self.stats.writes_dropped += 1
                return
            for key in keys[first:]:
                self._pending[key] = generation
            self._pending_bytes += nbytes
        self._writes.put(
            _Write(tuple(tokens[: num * CHUNK_TOKENS]), keys, first, layers, nbytes, generation)
        )

    def clear(self) -> tuple[int, int]:
        """Forget every entry of this model now (the files go on the writer thread); returns
        (entries, bytes) dropped."""
        with self._lock:
            freed = (len(self._index), self.num_bytes)
            doomed = list(self._index)
            self._index.clear()
            self.num_bytes = 0
            self._generation += 1
        self._writes.put(("delete", doomed))
        return freed

    def close(self, timeout: float = 5.0) -> None:
        """Stop the threads once queued writes are done (at most `timeout` seconds each);
        queued reads are dropped and one running stops at its next chunk (nobody takes
        them now: the engine has stopped)."""
        if self._closed:
            return
        self._closed = True
        with self._lock:
            self._landed.notify_all()  # a read waiting for a chunk stops waiting
        with contextlib.suppress(queue.Empty):
            while True:
                self._reads.get_nowait()
        self._writes.put(None)
        self._reads.put(None)
        self._writer.join(timeout)
        self._reader.join(timeout)

    def flush(self, timeout: float = 30.0) -> bool:
        """Wait until every queued write is on disk (tests, shutdown)."""
        done = threading.Event()
        self._writes.put(("mark", done))
        return done.wait(timeout)

    def describe(self, model_path: str | Path) -> None:
        """Name the model in its folder (`models rm` finds it there: `forget_model`)."""
        meta = {"model_path": str(Path(model_path).resolve()), "fingerprint": self.fingerprint}
        with contextlib.suppress(OSError):
            self.dir.mkdir(parents=True, exist_ok=True)
            (self.dir / MODEL_FILE).write_text(json.dumps(meta), encoding="utf-8")

    # -- writer thread -----------------------------------------------------------------------

    def _write_loop(self) -> None:
        while True:
            job = self._writes.get()
            if job is None:
                self._retire()
                return
            try:
                if isinstance(job, _Write):
                    self._write(job)
                elif job[0] == "scan":
                    self._scan()
                elif job[0] == "delete":
                    for key in job[1]:
                        _unlink(self._path(key))
                elif job[0] == "mark":
                    job[1].set()
            except Exception:
                log.exception("prompt cache disk tier: a write job failed")

    def _retire(self) -> None:
        """Closed, its writes done: its files are another model's for the tiers that stay on
        the folder (in the budget, and first to go)."""
        shared = self._shared
        with self._lock:
            mine = [(self._path(k), size) for k, (size, _) in self._index.items()]
        with shared.lock:
            shared.tiers.discard(self)
            if any(t.dir == self.dir for t in shared.tiers):
                return  # the same model loaded again meanwhile: its files are that tier's
            shared.foreign.extendleft(reversed(mine))
            shared.foreign_bytes += sum(size for _, size in mine)

    def _write(self, job: _Write) -> None:
        start = time.perf_counter()
        if self.write_delay_s:
            time.sleep(self.write_delay_s)
        written = 0
        try:
            parent = self._root_key if job.first == 0 else job.keys[job.first - 1]
            for i in range(job.first, len(job.keys)):
                key = job.keys[i]
                with self._lock:
                    stale = job.generation != self._generation
                    present = key in self._index
                if stale:
                    break
                if not present:
                    size = self._write_chunk(job, i, parent)
                    written += size
                    with self._lock:
                        if job.generation == self._generation:
                            self._index[key] = (size, 0)
                            self.num_bytes += size
                        else:
                            _unlink(self._path(key))
                        self.stats.writes += 1
                        self._landed.notify_all()
                    if self._write_failing:
                        self._write_failing = False
                        log.info("prompt cache disk tier: writing to %s works again", self.dir)
                parent = key
        except OSError as exc:
            with self._lock:
                self.stats.write_errors += 1
            if not self._write_failing:  # a full or read-only disk: said once, not per chunk
                self._write_failing = True
                log.warning(
                    "prompt cache disk tier: writing to %s failed (%s); prompts are not kept "
                    "on disk until a write works again (the RAM tier serves alone)",
                    self.dir,
                    exc,
                )
        finally:
            with self._lock:
                for key in job.keys[job.first :]:
                    if self._pending.get(key) == job.generation:
                        del self._pending[key]
                self._landed.notify_all()
                self._pending_bytes -= job.nbytes
                touched = self._touch(job.keys) if job.generation == self._generation else []
                self.stats.bytes_written += written
                self.stats.write_seconds += time.perf_counter() - start
            self._stamp(touched)
        self._evict_to_fit()

    def _write_chunk(self, job: _Write, index: int, parent: bytes) -> int:
        lo, hi = index * CHUNK_TOKENS, (index + 1) * CHUNK_TOKENS
        pieces, shapes = [], []
        dtype = ""
        for keys, values in job.layers:
            layer_shapes = []
            for arr in (keys, values):
                data = _as_bytes_array(arr)  # (batch, heads, n, dim * itemsize) uint8
                piece = np.ascontiguousarray(data[:, :, lo:hi, :])
                pieces.append(piece)
                layer_shapes.append(
                    [int(arr.shape[0]), int(arr.shape[1]), CHUNK_TOKENS, int(arr.shape[3])]
                )
                dtype = _dtype_name(arr)
            shapes.append(layer_shapes)
        crc = 0
        length = 0
        for piece in pieces:
            crc = zlib.crc32(piece, crc)  # type: ignore[arg-type]  # an ndarray is a buffer
            length += piece.nbytes
        header = json.dumps(
            {
                "format": FORMAT_VERSION,
                "fingerprint": self.fingerprint,
                "key": job.keys[index].hex(),
                "parent": parent.hex(),
                "index": index,
                "tokens": list(job.tokens[lo:hi]),
                "dtype": dtype,
                "shapes": shapes,
                "data_bytes": length,
                "crc32": crc,
            }
        ).encode()
        path = self._path(job.keys[index])
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_name(f"{path.name}.{os.getpid()}{TMP_SUFFIX}")
        try:
            with open(tmp, "wb") as f:
                f.write(_HEAD.pack(MAGIC, len(header)))
                f.write(header)
                for piece in pieces:
                    f.write(piece.data)
            os.replace(tmp, path)
        except BaseException:  # e.g. ENOSPC: the part written goes now, not at the next start
            _unlink(tmp)
            raise
        return _HEAD.size + len(header) + length

    def _scan(self) -> None:
        """At start: index this model's chunks (oldest use first), list the files of no live
        tier for the budget, delete temporary files that a killed writer left."""
        mine: list[tuple[int, bytes, int]] = []
        foreign: list[tuple[int, Path, int]] = []
        with self._lock:
            generation = self._generation
        live = {t.dir for t in self._shared.live()}
        try:
            subs = list(self.root.iterdir()) if self.root.is_dir() else []
        except OSError as exc:
            log.warning("prompt cache disk tier: cannot list %s (%s)", self.root, exc)
            subs = []
        for sub in subs:
            if sub in live and sub != self.dir:
                continue  # a tier of this process counts those (another resident model)
            try:
                paths = list(sub.rglob("*")) if sub.is_dir() else []
            except OSError:
                continue
            for path in paths:
                try:
                    st = path.stat()
                except OSError:
                    continue
                if not path.is_file() or path.name == MODEL_FILE:
                    continue
                if path.name.endswith(TMP_SUFFIX):
                    if _abandoned(path, st):
                        _unlink(path)
                    continue
                if sub == self.dir and path.suffix == SUFFIX:
                    try:
                        key = bytes.fromhex(path.stem)
                    except ValueError:
                        key = b""
                    if len(key) == 32:
                        mine.append((st.st_mtime_ns, key, st.st_size))
                        continue
                foreign.append((st.st_mtime_ns, path, st.st_size))
        mine.sort()
        foreign.sort()
        with self._lock:
            if generation != self._generation:  # a reset while the scan ran: they go too
                stale, mine = [self._path(key) for _, key, _ in mine], []
            else:
                stale = []
            for stamp, key, size in mine:
                if key not in self._index:
                    self._index[key] = (size, stamp)
                    self.num_bytes += size
            self.ready = True
        for path in stale:
            _unlink(path)
        shared = self._shared
        with shared.lock:  # the newest view of the folder; this tier's files are its own now
            shared.foreign = deque((p, s) for _, p, s in foreign)
            shared.foreign_bytes = sum(s for _, _, s in foreign)
        if mine or foreign:
            log.info(
                "prompt cache disk tier: %d chunks of this model (%.1f MiB), %.1f MiB of others",
                len(mine),
                self.num_bytes / 2**20,
                shared.foreign_bytes / 2**20,
            )
        self._evict_to_fit()

    def _evict_to_fit(self) -> None:
        """Within the byte budget, with every live tier on the folder and the files of none:
        those go first, then the least recently used chunk of any live tier (writer
        thread; one lock held at a time)."""
        shared = self._shared
        while True:
            live = shared.live()
            with shared.lock:
                total = shared.foreign_bytes + _live_bytes(live)
                if total <= self.capacity_bytes:
                    return
                path = None
                if shared.foreign:
                    path, size = shared.foreign.popleft()
                    shared.foreign_bytes -= size
            if path is None:
                counted = _counted(live)
                heads = [(stamp, t) for t in counted if (stamp := t._oldest()) is not None]
                if not heads:
                    return
                path = min(heads, key=lambda h: h[0])[1]._evict_oldest()
            if path is not None:
                _unlink(path)

    def _oldest(self) -> int | None:
        """The last use (ns) of this tier's least recently used chunk, if any."""
        with self._lock:
            return next(iter(self._index.values()))[1] if self._index else None

    def _evict_oldest(self) -> Path | None:
        with self._lock:
            if not self._index:
                return None
            key, (size, _) = self._index.popitem(last=False)
            self.num_bytes -= size
            self.stats.evictions += 1
        return self._path(key)

    # -- reader thread -----------------------------------------------------------------------

    def _read_loop(self) -> None:
        while True:
            job = self._reads.get()
            if job is None:
                return
            tag, tokens, keys, generation = job
            start = time.perf_counter()
            try:
                layers, dtype, num = self._read(tokens, keys)
            except Exception:
                log.exception("prompt cache disk tier: a read failed; the prompt is prefilled")
                layers, dtype, num = None, "", 0
            seconds = time.perf_counter() - start
            with self._lock:  # the engine thread counts lookups and misses too
                self.stats.reads += 1
                self.stats.read_seconds += seconds
                if num:
                    self.stats.hits += 1
                    self.stats.hit_tokens += num
                else:
                    self.stats.misses += 1
            read = DiskRead(tag, tokens[:num], num, layers, dtype, seconds, generation)
            self._done.append(read)
            try:  # the reader must outlive a failing callback: a reading request waits on it
                self.on_read_done()
            except Exception:
                log.exception("prompt cache disk tier: waking the engine failed")

    def _wait_written(self, key: bytes) -> None:
        """A chunk still queued for the writer: wait until it is written or given up, at
        most PENDING_WAIT_S (then the read ends before it)."""
        deadline = time.monotonic() + PENDING_WAIT_S
        with self._lock:
            while key not in self._index and key in self._pending and not self._closed:
                left = deadline - time.monotonic()
                if left <= 0:
                    return
                self._landed.wait(left)

    def _read(
        self, tokens: tuple[int, ...], keys: list[bytes]
    ) -> tuple[list[tuple[Any, Any]] | None, str, int]:
        """The chunks' layers, as far as the files are sound (checks: the module's NOTE)."""
        import mlx.core as mx

        # each layer's keys and values, for all the chunks asked, written straight into the
        # memory of their mlx arrays (`_layer_arrays`) as each chunk is checked, so a long read
        # holds its KV once (and one file), not the files and the KV both
        arrays: list[Any] = []
        buffers: list[np.ndarray] = []
        dtype, shapes = "", None
        parent = self._root_key
        num = 0
        for i, key in enumerate(keys):
            if self._closed:
                return None, "", 0
            self._wait_written(key)
            path = self._path(key)
            expect = tokens[i * CHUNK_TOKENS : (i + 1) * CHUNK_TOKENS]
            try:
                data = path.read_bytes()
            except FileNotFoundError:
                self._forget(key)
                break
            except OSError as exc:
                self._reject(key, path, f"unreadable ({exc})")
                break
            verdict = _check(data, self.fingerprint, key, parent, i, expect, shapes, dtype)
            if isinstance(verdict, str):
                self._reject(key, path, verdict)
                break
            header, body = verdict
            if shapes is None:
                dtype, shapes = header["dtype"], header["shapes"]
                total = len(keys) * CHUNK_TOKENS
                arrays, buffers = _layer_arrays(shapes, total, _NP_DTYPES[dtype])
            lo, hi = i * CHUNK_TOKENS, (i + 1) * CHUNK_TOKENS
            for buf, piece in zip(buffers, body, strict=True):
                b, h = buf.shape[:2]
                buf[:, :, lo:hi, :] = piece.reshape(b, h, CHUNK_TOKENS, -1)
            with self._lock:
                self.stats.bytes_read += len(data)
            del data, body, verdict
            num = hi
            parent = key
        if not num or shapes is None:
            return None, "", 0
        with self._lock:
            touched = self._touch(keys[: num // CHUNK_TOKENS])
        self._stamp(touched)
        np_dtype = _NP_DTYPES[dtype]
        for i in reversed(range(len(buffers))):  # each view goes as its array is final
            buf = buffers.pop()
            if num < buf.shape[2]:  # a chunk failed: the sound part, copied (rare)
                arrays[i] = mx.array(np.ascontiguousarray(buf[:, :, :num, :]).view(np_dtype))
            elif arrays[i] is None:  # staged in numpy: mlx gave no writable view
                arrays[i] = mx.array(buf.view(np_dtype))
            del buf
        layers = [(arrays[2 * j], arrays[2 * j + 1]) for j in range(len(shapes))]
        return layers, dtype, num

    def _reject(self, key: bytes, path: Path, why: str) -> None:
        log.warning(
            "prompt cache disk tier: %s is %s; deleted, the prompt is prefilled", path.name, why
        )
        with self._lock:
            self.stats.rejected += 1
        self._forget(key)
        _unlink(path)

    def _forget(self, key: bytes) -> None:
        with self._lock:
            entry = self._index.pop(key, None)
            if entry is not None:
                self.num_bytes -= entry[0]

    # -- helpers -----------------------------------------------------------------------------

    def _touch(self, keys: Sequence[bytes]) -> list[tuple[bytes, int]]:
        """Most recently used: the chain's first chunk; its last goes first (lock held).
        Returns (key, stamp) of those on disk, for `_stamp`."""
        now = time.time_ns()
        touched = []
        for i, key in enumerate(reversed(keys)):
            entry = self._index.get(key)
            if entry is not None:
                self._index[key] = (entry[0], now + i)
                self._index.move_to_end(key)
                touched.append((key, now + i))
        return touched

    def _stamp(self, touched: Sequence[tuple[bytes, int]]) -> None:
        """The same order in the files' times, which the next start's scan reads (no lock:
        a write job and a read both stamp the chain they used, the first chunk last)."""
        for key, stamp in touched:
            with contextlib.suppress(OSError):
                os.utime(self._path(key), ns=(stamp, stamp))

    def _path(self, key: bytes) -> Path:
        name = key.hex()
        return self.dir / name[:2] / f"{name}{SUFFIX}"

    def info(self) -> dict[str, Any]:
        """The tier's figures: its counters (`DiskStats`) and its state, the fields of the
        snapshot's `DiskCacheInfo`."""
        return {
            **asdict(self.stats),
            "ready": self.ready,
            "dir": str(self.dir),
            "entries": len(self._index),
            "bytes": self.num_bytes,
            "other_bytes": self._other_bytes(),
            "capacity_bytes": self.capacity_bytes,
            "chunk_tokens": CHUNK_TOKENS,
            "pending_bytes": self._pending_bytes,
        }

    def _other_bytes(self) -> int:
        """Bytes in this tier's budget that are not its own: other models' files, and the
        other live tiers' on the same folder."""
        others = _live_bytes([t for t in self._shared.live() if t.dir != self.dir])
        return self._shared.foreign_bytes + others


def _counted(tiers: Sequence[DiskTier]) -> list[DiskTier]:
    """One live tier per folder, the one indexing the most (a model loaded again while its
    old tier still closes: both index the same files; the budget and the evictions go by
    that one)."""
    by_dir: dict[Path, DiskTier] = {}
    for t in tiers:
        if t.dir not in by_dir or t.num_bytes > by_dir[t.dir].num_bytes:
            by_dir[t.dir] = t
    return list(by_dir.values())


def _live_bytes(tiers: Sequence[DiskTier]) -> int:
    return sum(t.num_bytes for t in _counted(tiers))


def _unlink(path: Path) -> None:
    """Delete a file if it is there; a disk that refuses (read-only) is not an error here."""
    with contextlib.suppress(OSError):
        path.unlink(missing_ok=True)


def _abandoned(tmp: Path, st: os.stat_result) -> bool:
    """A temporary file no live writer will rename: its process is gone (name.<pid>.tmp),
    or it is over an hour old."""
    if time.time() - st.st_mtime > 3600:
        return True
    try:
        pid = int(tmp.name[: -len(TMP_SUFFIX)].rsplit(".", 1)[1])
    except (IndexError, ValueError):
        return True
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return True
    except OSError:  # alive, another user's
        return False
    return False


def _evaluate(layers: Sequence[tuple[Any, Any]]) -> None:
    """Evaluate mlx arrays on the calling (engine) thread: mlx cannot evaluate on the writer
    thread (it has no stream there), and an evaluated array's bytes never change."""
    arrays = [a for pair in layers for a in pair if type(a).__module__.startswith("mlx")]
    if arrays:
        import mlx.core as mx

        mx.eval(arrays)


def _dtype_name(arr: Any) -> str:
    return str(arr.dtype).rsplit(".", 1)[-1]


def _as_bytes_array(arr: Any) -> np.ndarray:
    """An evaluated (b, h, n, d) mlx array's bytes as (b, h, n, d * itemsize) uint8: without a
    copy when it is contiguous (the prompt cache's payloads are), else copied."""
    b, h, n, d = arr.shape
    view = memoryview(arr)
    if view.c_contiguous:
        raw = np.frombuffer(view.cast("B"), dtype=np.uint8)
    else:  # a view into a longer cache: copied (numpy knows no bfloat16: bytes, not items)
        raw = np.frombuffer(view.tobytes(), dtype=np.uint8)
    return raw.reshape(b, h, n, d * arr.itemsize)


def _layer_arrays(
    shapes: list[Any], total: int, np_dtype: Any
) -> tuple[list[Any], list[np.ndarray]]:
    """Each layer's keys and values for `total` tokens, as fresh mlx arrays and writable byte
    views of their memory, which a read fills chunk by chunk: one copy of the bytes, into
    memory the kernel hands out once (a numpy buffer then `mx.array` was two, the first into
    fresh huge pages on Linux: ~2x the read of a restarted agent's prefix). Where mlx gives
    no writable contiguous view, or its memory is not the host's own (CUDA: a view there is
    not known to reach the device's copy), that array is None and its buffer a numpy one,
    made into an array at the end."""
    import mlx.core as mx

    direct = mx.default_device().type == mx.cpu or mx.metal.is_available()
    itemsize = np.dtype(np_dtype).itemsize
    arrays: list[Any] = []
    buffers: list[np.ndarray] = []
    for layer in shapes:
        for b, h, _, d in layer:
            arr = mx.array(np.zeros((b, h, total, d), dtype=np_dtype)) if direct else None
            view = None if arr is None else _writable_view(arr)
            if view is not None:
                arrays.append(arr)
                buffers.append(view)
            else:  # staged; so are the rest (no array made only to be dropped)
                direct = False
                arrays.append(None)
                buffers.append(np.empty((b, h, total, d * itemsize), dtype=np.uint8))
    return arrays, buffers


def _writable_view(arr: Any) -> np.ndarray | None:
    """A writable byte view of an evaluated array's own contiguous memory, else None."""
    view = np.asarray(memoryview(arr))
    if view.flags.writeable and view.flags.c_contiguous and view.shape == tuple(arr.shape):
        return view.view(np.uint8)
    return None


def _check(
    data: bytes,
    fingerprint: str,
    key: bytes,
    parent: bytes,
    index: int,
    tokens: Sequence[int],
    shapes: Any,
    dtype: str,
) -> tuple[dict[str, Any], list[np.ndarray]] | str:
    """(header, per-array byte views) of a sound chunk file, else why it is not."""
    if len(data) < _HEAD.size:
        return "truncated"
    magic, header_len = _HEAD.unpack_from(data)
    if magic != MAGIC:
        return "not a prompt cache file"
    if header_len > MAX_HEADER_BYTES or _HEAD.size + header_len > len(data):
        return "truncated"
    try:
        header = json.loads(data[_HEAD.size : _HEAD.size + header_len])
    except ValueError:
        return "corrupt (its header)"
    if not isinstance(header, dict) or header.get("format") != FORMAT_VERSION:
        return "of another format"
    if header.get("fingerprint") != fingerprint or header.get("key") != key.hex():
        return "of another model"
    if header.get("parent") != parent.hex() or header.get("index") != index:
        return "of another prefix"
    if header.get("tokens") != list(tokens):
        return "of other tokens"
    if hashlib.sha256(parent + _chunk_bytes(tokens)).digest() != key:
        return "of other tokens"
    got_dtype, got_shapes = header.get("dtype"), header.get("shapes")
    if got_dtype not in _NP_DTYPES or not isinstance(got_shapes, list) or not got_shapes:
        return "corrupt (its layout)"
    if shapes is not None and (got_shapes != shapes or got_dtype != dtype):
        return "of another layout"
    body = memoryview(data)[_HEAD.size + header_len :]
    if len(body) != header.get("data_bytes"):
        return "truncated"
    if zlib.crc32(body) != header.get("crc32"):
        return "corrupt (checksum)"
    itemsize = np.dtype(_NP_DTYPES[got_dtype]).itemsize
    arrays, offset = [], 0
    try:
        for layer in got_shapes:
            for b, h, n, d in layer:
                size = b * h * n * d * itemsize
                if n != CHUNK_TOKENS or size <= 0:
                    return "corrupt (its layout)"
                arrays.append(np.frombuffer(body[offset : offset + size], dtype=np.uint8))
                offset += size
    except (TypeError, ValueError):
        return "corrupt (its layout)"
    if offset != len(body):
        return "corrupt (its layout)"
    return header, arrays

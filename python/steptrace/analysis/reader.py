"""Read steptrace JSON Lines logs back as dicts.

A log is one file per rank (``rank<N>.jsonl``) in a run folder. Each file starts with a
``run_start`` record naming the schema (``steptrace/1``), then one JSON object per line.
:func:`read` streams the records of one file, a run folder, or a list of either, with
bounded memory; :func:`validate_record` checks one record against the JSON schema.

A truncated last line (the process died mid-write) is skipped with a
:class:`TruncatedLogWarning`, never an error; so are torn lines in the middle of a file
(lines that are not JSON: a write cut off mid-line, e.g. by a crash before the file was
appended to again, or a full disk), counted in one :class:`TornLineWarning` per file.
Anything else that is not a steptrace record raises
:class:`steptrace.errors.LogFormatError` naming the file and line, and so does a folder
whose files come from different runs.
"""

from __future__ import annotations

import functools
import json
import os
import re
import warnings
from pathlib import Path
from typing import Any, Callable, Iterator, Optional, Sequence, Union

from steptrace._progress import Progress
from steptrace.errors import LogFormatError

PathArg = Union[str, "os.PathLike[str]"]
Paths = Union[PathArg, Sequence[PathArg]]

#: The newest schema version this reader understands.
SCHEMA_VERSION = 1
SCHEMA_NAME = f"steptrace/{SCHEMA_VERSION}"
_SCHEMA_FILE = "steptrace-1.schema.json"
# ASCII digits, and few of them: int() of 5,000 digits raises (Python's 4,300-digit limit),
# and \d also matches other scripts' digits, which no steptrace writes.
_SCHEMA_RE = re.compile(r"steptrace/([0-9]{1,9})")
_SCHEMA_ANY_RE = re.compile(r"steptrace/[0-9]+")
_RANK_RE = re.compile(r"rank([0-9]{1,9})\.jsonl$")
_RECORD_START = re.compile(rb'\{\s*"kind"\s*:')
_TORN_LINES_NAMED = 5  # line numbers a TornLineWarning lists
_TEAR_TRIES = 8  # record starts tried in a torn line, from its end


class ReaderWarning(UserWarning):
    """Base class of the warnings the reader emits (the CLI prints them on one line)."""


class TruncatedLogWarning(ReaderWarning):
    """The last line of a log was cut off mid-write (a crash); it was skipped."""


class CorruptLineWarning(ReaderWarning):
    """A corrupt line was skipped because ``skip_bad=True``."""


class TornLineWarning(ReaderWarning):
    """Lines in the middle of a log that are not JSON (torn writes) were skipped; one
    warning per file, once its reading ends: ``path``, ``count`` and the first ``lines``."""

    def __init__(self, message: str, path: str = "", count: int = 0, lines: tuple = ()) -> None:
        super().__init__(message)
        self.path, self.count, self.lines = path, count, lines


def _reject_constant(name: str) -> Any:
    # NaN/Infinity are not JSON; orjson rejects them, so the json fallback must too,
    # or a log would read differently depending on what happens to be installed.
    raise ValueError(f"{name} is not valid JSON")


_loads: Callable[[bytes], Any]
try:  # orjson is several times faster; it takes bytes and rejects NaN by itself
    import orjson

    _loads = orjson.loads
except ImportError:  # pragma: no cover - depends on the environment
    _decoder = json.JSONDecoder(parse_constant=_reject_constant)
    _scan = _decoder.scan_once

    def _loads(line: bytes) -> Any:
        # The C scanner directly is ~20% faster than decode(); decode() is the fallback
        # for the rare line with leading or trailing junk, and gives the proper error.
        text = line.decode("utf-8")
        try:
            obj, end = _scan(text, 0)
        except StopIteration:  # nothing parseable at index 0 (blank line, leading space, junk)
            return _decoder.decode(text)
        except RecursionError:  # '[' nested thousands deep: junk, as orjson says (limit 1024)
            raise ValueError("JSON nested too deeply") from None
        if end != len(text) and not text[end:].isspace():
            return _decoder.decode(text)  # raises "Extra data"
        return obj


# --------------------------------------------------------------------------- paths


def _rank_key(path: Path) -> tuple[int, int, str]:
    """Sort ``rank2.jsonl`` before ``rank10.jsonl``; files without a rank go last, by name."""
    m = _RANK_RE.search(path.name)
    return (0, int(m.group(1)), path.name) if m else (1, 0, path.name)


def _resolve(paths: Paths) -> list[tuple[Path, Optional[Path]]]:
    """The log files named by ``paths``, in reading order, each with the folder it was
    found in (None for a file named directly); raises LogFormatError eagerly."""
    if isinstance(paths, (str, os.PathLike)):
        items: Sequence[PathArg] = [paths]
    elif isinstance(paths, (list, tuple)):
        items = paths
        if not items:
            raise LogFormatError("no log paths given")
    else:
        raise TypeError(f"read() expects a path or a list of paths, not {type(paths).__name__}")
    files: list[tuple[Path, Optional[Path]]] = []
    for item in items:
        p = Path(item)
        if p.is_dir():
            found = sorted((f for f in p.glob("*.jsonl") if f.is_file()), key=_rank_key)
            if not found:
                raise LogFormatError(f"{p}: directory holds no .jsonl log files")
            files.extend((f, p) for f in found)
        elif p.exists():
            if not p.is_file():
                raise LogFormatError(f"{p}: not a regular file")
            files.append((p, None))
        else:
            raise LogFormatError(f"{p}: no such file or directory")
    return files


def log_files(path: Paths) -> list[Path]:
    """The log files :func:`read` would read for ``path``, in order."""
    return [f for f, _ in _resolve(path)]


# --------------------------------------------------------------------------- reading


def read(path: Paths, *, skip_bad: bool = False, validate: bool = False,
         progress: Union[bool, Progress] = False) -> Iterator[dict[str, Any]]:
    """Stream the records of a log file, a run folder, or a list/tuple of either.

    A folder is read file by file, ``rank<N>.jsonl`` in rank order; its files must be the
    ranks of one run, else LogFormatError ("mixed runs"): one rank each, one world size,
    and one ``run_id`` (ids the profiler generated per process, as under torchrun without
    a rendezvous id, may differ when the ranks started within ten minutes). Each record is a dict with at least ``"kind"``. Paths are checked
    now (missing path, folder without logs raise :class:`LogFormatError` at once); file
    contents are read lazily, one line at a time. A torn line after the first (not JSON:
    a write cut off mid-line) is always skipped, and counted in one
    :class:`TornLineWarning` per file. ``skip_bad=True`` also turns a record that is not a
    steptrace record (JSON that is not an object, or has no ``"kind"``; with ``validate``,
    an invalid record) into a :class:`CorruptLineWarning`; the first record must always
    be a valid ``run_start``.
    ``validate=True`` checks every record against the JSON schema (slow: use it in tests
    and tools, not on large logs). ``progress=True`` draws a progress bar on stderr when
    stderr is a terminal and the read takes more than half a second.
    """
    files = _resolve(path)
    bar: Optional[Progress] = None
    if isinstance(progress, Progress):
        bar = progress
    elif progress:
        total = 0
        for f, _ in files:
            try:
                total += f.stat().st_size
            except OSError:
                pass
        label = f"reading {os.fspath(path)}" if isinstance(path, (str, os.PathLike)) else "reading"
        bar = Progress(total, label)
        if not bar.enabled:
            bar = None
    return _read_files(files, skip_bad, validate, bar)


#: A run id the profiler made up itself (time, host, pid): every rank of a torchrun job
#: without a rendezvous id gets its own, so such ids may differ within one run.
_AUTO_RUN_ID = re.compile(r"\d{8}T\d{6}Z-.*-\d+")
#: Ranks of one run start within this many seconds of each other.
SAME_RUN_WINDOW_S = 600


def _same_run(a: dict[str, Any], b: dict[str, Any]) -> Optional[str]:
    """None when the run_starts ``a`` and ``b`` (two files of one folder) can be ranks of
    one run, else why not."""
    fa, fb = a["_file"].name, b["_file"].name
    if a.get("rank") == b.get("rank"):
        return f"{fa} and {fb} are both rank {_brief(a.get('rank'))}"
    if a.get("world_size") != b.get("world_size"):
        return f"{fa} has world_size {_brief(a.get('world_size'))} but {fb} has {_brief(b.get('world_size'))}"
    ra, rb = a.get("run_id"), b.get("run_id")
    if ra == rb:
        return None
    auto = all(isinstance(r, str) and _AUTO_RUN_ID.fullmatch(r) for r in (ra, rb))
    ta, tb = a.get("start_unix_ns"), b.get("start_unix_ns")
    close = isinstance(ta, int) and isinstance(tb, int) and abs(ta - tb) <= SAME_RUN_WINDOW_S * 10**9
    if auto and close:
        return None  # generated per process (torchrun without a run id): the same job
    return f"{fa} is run {_brief(ra)} but {fb} is run {_brief(rb)}"


def _ticker(bar: Progress, base: int) -> Callable[[int], None]:
    """Progress callback for one file: ``pos`` bytes into it, ``base`` bytes before it."""
    return lambda pos: bar.update(base + pos)


def _read_files(files: list[tuple[Path, Optional[Path]]], skip_bad: bool, validate: bool,
                bar: Optional[Progress] = None) -> Iterator[dict[str, Any]]:
    seen: dict[Path, list[dict[str, Any]]] = {}  # folder -> the run_starts read from it
    done = 0
    try:
        for f, folder in files:
            tick = None if bar is None else _ticker(bar, done)
            records = _read_file(f, skip_bad, validate, tick)
            header = next(records)  # _read_file always yields the run_start first, or raises
            if folder is not None:
                this = {"_file": f, **{k: header.get(k) for k in ("rank", "world_size", "run_id", "start_unix_ns")}}
                for other in seen.get(folder, ()):
                    why = _same_run(other, this)
                    if why is not None:
                        raise LogFormatError(f"{folder}: mixed runs in one folder: {why} (keep one run per folder)")
                seen.setdefault(folder, []).append(this)
            yield header
            yield from records
            if bar is not None:
                try:
                    done += f.stat().st_size
                except OSError:
                    pass
                bar.update(done)
    finally:
        if bar is not None:
            bar.close()


def _bad(where: str, problem: str, skip_bad: bool) -> None:
    """Raise for a corrupt line, or warn when the caller asked to skip them."""
    if not skip_bad:
        raise LogFormatError(f"{where}: {problem}")
    warnings.warn(f"{where}: skipped: {problem}", CorruptLineWarning, stacklevel=4)


def _check_header(name: str, lineno: int, rec: Any) -> None:
    """The first record must be a run_start naming a schema this reader understands."""
    where = f"{name}:{lineno}"
    if type(rec) is not dict or rec.get("kind") != "run_start":
        raise LogFormatError(f"{where}: not a steptrace log (first record is not a run_start)")
    schema = rec.get("schema")
    m = _SCHEMA_RE.fullmatch(schema) if isinstance(schema, str) else None
    if m is None and isinstance(schema, str) and _SCHEMA_ANY_RE.fullmatch(schema):
        raise LogFormatError(f"{where}: unknown schema version {_brief(schema)}")
    if m is None:
        raise LogFormatError(f"{where}: not a steptrace log (run_start has no steptrace schema, got {_brief(schema)})")
    version = int(m.group(1))
    if version > SCHEMA_VERSION:
        raise LogFormatError(
            f"{where}: log written by a newer steptrace (schema {schema}; this reader "
            f"understands {SCHEMA_NAME}): upgrade steptrace to read it"
        )
    if version < 1:
        raise LogFormatError(f"{where}: unknown schema version {_brief(schema)}")


#: No steptrace record comes near this (a run_end with 1,000 top kernels is ~2 MiB); a
#: longer line is junk, and parsing it could take 30x its size in Python objects.
MAX_LINE_BYTES = 16 << 20


def _lines(fh: Any) -> Iterator[bytes]:
    """The lines of ``fh``. A line longer than MAX_LINE_BYTES is read in pieces, never held
    whole, and comes as ``b"\\0\\n"``, which no parser takes: a torn line to the loops
    below (``b"\\0"``, a truncated last line, when the file ends inside it)."""
    read = functools.partial(fh.readline, MAX_LINE_BYTES + 1)
    for line in iter(read, b""):
        if len(line) > MAX_LINE_BYTES:
            while not line.endswith(b"\n"):
                line = read()
                if not line:
                    yield b"\0"
                    return
            yield b"\0\n"
            continue
        yield line


def _read_file(path: Path, skip_bad: bool, validate: bool,
               tick: Optional[Callable[[int], None]] = None) -> Iterator[dict[str, Any]]:
    name = str(path)
    loads = _loads
    # 1 MiB buffer: fewer read syscalls on big logs; memory stays bounded.
    with open(path, "rb", buffering=1 << 20) as fh:
        lines = enumerate(_lines(fh), 1)

        # Header: the first non-empty line. skip_bad never applies here, so a file that
        # is not a steptrace log at all cannot pass as an empty one.
        header = None
        for lineno, line in lines:
            try:
                header = loads(line)
            except ValueError:  # JSONDecodeError, orjson.JSONDecodeError, UnicodeDecodeError
                if line.isspace():
                    continue
                if not line.endswith(b"\n"):
                    warnings.warn(
                        f"{name}:{lineno}: truncated last line skipped (the run crashed mid-write)",
                        TruncatedLogWarning,
                        stacklevel=3,
                    )
                    raise LogFormatError(f"{name}: empty log (no complete record)") from None
                raise LogFormatError(f"{name}:{lineno}: not a steptrace log (line is not JSON)") from None
            _check_header(name, lineno, header)
            if validate:
                _validate_at(name, lineno, header)
            yield header
            break
        if header is None:
            raise LogFormatError(f"{name}: empty log (no records)")

        # Body: the hot loop; keep the per-line work to one parse and two cheap checks.
        torn: list[int] = []  # line numbers of torn lines (the first few), and their count
        torn_count = recovered = 0
        try:
            for lineno, line in lines:
                if tick is not None and not lineno & 0xFFF:
                    tick(fh.tell())
                try:
                    rec = loads(line)
                except ValueError:
                    if line.isspace():
                        continue
                    if not line.endswith(b"\n"):  # only the last line can lack its newline
                        warnings.warn(
                            f"{name}:{lineno}: truncated last line skipped (the run crashed mid-write)",
                            TruncatedLogWarning,
                            stacklevel=3,
                        )
                        break
                    # A torn line (a write cut off mid-line): skipped and counted, reading
                    # goes on; a complete record it ends with (the next write) is kept.
                    torn_count += 1
                    if len(torn) < _TORN_LINES_NAMED:
                        torn.append(lineno)
                    rec = _record_after_tear(line)
                    if rec is None:
                        continue
                    recovered += 1
                if type(rec) is not dict:
                    _bad(f"{name}:{lineno}", f"record is not a JSON object (got {type(rec).__name__})", skip_bad)
                    continue
                if "kind" not in rec:
                    _bad(f"{name}:{lineno}", 'record has no "kind"', skip_bad)
                    continue
                if validate:
                    try:
                        _validate_at(name, lineno, rec)
                    except LogFormatError as exc:
                        if not skip_bad:
                            raise
                        warnings.warn(f"skipped: {exc}", CorruptLineWarning, stacklevel=3)
                        continue
                yield rec
        finally:
            if torn_count:
                _warn_torn(name, torn_count, torn, recovered)


def _one_line(exc: BaseException) -> str:
    return " ".join(str(exc).split())


def _record_after_tear(line: bytes) -> Optional[dict[str, Any]]:
    """The complete record a torn line ends with: the write after the cut-off one (say,
    a resumed run appending to the file) starts mid-line; None when there is none."""
    starts = [m.start() for m in _RECORD_START.finditer(line, 1)]
    # the last few starts only: a line of junk may hold thousands, and each try parses the
    # rest of the line (all of them: quadratic time)
    for start in reversed(starts[-_TEAR_TRIES:]):
        try:
            rec = _loads(line[start:])
        except ValueError:
            continue
        return rec if type(rec) is dict else None
    return None


def _warn_torn(name: str, count: int, lines: list[int], recovered: int) -> None:
    """One warning for a file's torn lines, with their count."""
    if count == 1:
        where = f"{name}:{lines[0]}: torn line skipped"
    else:
        named = ", ".join(map(str, lines)) + (", ..." if count > len(lines) else "")
        where = f"{name}: {count} torn lines skipped (lines {named})"
    kept = f"; {recovered} complete record{'s' if recovered != 1 else ''} after a tear kept" if recovered else ""
    message = f"{where}: not JSON, a write cut off mid-line (a crash, a full disk){kept}; reading went on"
    warnings.warn(TornLineWarning(message, name, count, tuple(lines)), stacklevel=4)


# --------------------------------------------------------------------------- schema


def _schema_path() -> Any:
    """The packaged schema when installed, else the repository's schema/ folder."""
    try:
        from importlib.resources import files

        packaged = files("steptrace") / _SCHEMA_FILE
        if packaged.is_file():
            return packaged
    except (ImportError, TypeError):  # pragma: no cover - not importable as a package
        pass
    return Path(__file__).resolve().parents[3] / "schema" / _SCHEMA_FILE


@functools.lru_cache(maxsize=None)
def load_schema() -> dict[str, Any]:
    """The steptrace/1 JSON schema as a dict (loaded once)."""
    src = _schema_path()
    try:
        return json.loads(src.read_text(encoding="utf-8"))
    except FileNotFoundError:
        raise LogFormatError(f"the steptrace schema file {_SCHEMA_FILE} is missing from the installation") from None


@functools.lru_cache(maxsize=None)
def _validator() -> Any:
    from jsonschema import Draft202012Validator

    return Draft202012Validator(load_schema())


@functools.lru_cache(maxsize=None)
def _kind_validator(kind: str) -> Any:
    # The top-level oneOf gives "is not valid under any of the given schemas"; checking
    # the record against its own kind's definition names the field that is wrong.
    from jsonschema import Draft202012Validator

    defs = load_schema()["$defs"]
    return Draft202012Validator({"$ref": f"#/$defs/{kind}", "$defs": defs})


@functools.lru_cache(maxsize=None)
def _record_kinds() -> frozenset[str]:
    """Record kinds the schema defines (the targets of its top-level oneOf)."""
    refs = (alt.get("$ref", "") for alt in load_schema().get("oneOf", []))
    return frozenset(r.rsplit("/", 1)[-1] for r in refs if r.startswith("#/$defs/"))


def validate_record(record: Any) -> None:
    """Check one record against schema steptrace/1; raise LogFormatError saying what is wrong."""
    from jsonschema.exceptions import best_match

    full = _validator()
    try:
        errors = list(full.iter_errors(record))
    except RecursionError:  # jsonschema recurses per level; no steptrace record nests deeply
        raise LogFormatError(f"record does not match schema {SCHEMA_NAME}: nested too deeply") from None
    if not errors:
        return
    kind = record.get("kind") if isinstance(record, dict) else None
    label = f"{kind} record" if isinstance(kind, str) else "record"
    if isinstance(kind, str) and kind in _record_kinds():
        specific = list(_kind_validator(kind).iter_errors(record))
        if specific:
            errors = specific
    elif isinstance(record, dict) and "kind" in record:
        raise LogFormatError(f"unknown record kind {_brief(kind)} (schema {SCHEMA_NAME})")
    err = best_match(errors)
    where = "/".join(str(p) for p in err.absolute_path)
    at = f" at {where}" if where else ""
    raise LogFormatError(_shorten(f"{label} does not match schema {SCHEMA_NAME}{at}: {_shorten(err.message)}", 600))


def _brief(value: Any) -> str:
    """A value of a log in an error message: its repr, cut short (a corrupt log may hold
    a 24 MiB string where the schema name should be)."""
    text = repr(value) if isinstance(value, (str, int, float, bool, type(None))) else f"a {type(value).__name__}"
    return text if len(text) <= 80 else text[:77] + "..."


def _shorten(message: str, limit: int = 300) -> str:
    message = " ".join(message.split())
    return message if len(message) <= limit else message[: limit - 3] + "..."


def _validate_at(name: str, lineno: int, rec: Any) -> None:
    try:
        validate_record(rec)
    except LogFormatError as exc:
        raise LogFormatError(f"{name}:{lineno}: {exc}") from None


__all__ = [
    "read",
    "log_files",
    "validate_record",
    "load_schema",
    "ReaderWarning",
    "TruncatedLogWarning",
    "CorruptLineWarning",
    "TornLineWarning",
    "SCHEMA_VERSION",
    "SCHEMA_NAME",
]

"""The log fuzzer of test_fuzz_reader.py: seed logs, mutators, and the oracle that runs a
mutant through the reader, ``steptrace.load`` and every log-reading CLI subcommand.

A mutant passes when every call either gives a correct result or a clean error: the API
raises a :class:`steptrace.SteptraceError` (nothing else), the CLI returns 0/1 with
well-formed output or 2 with one ``steptrace: error: ...`` line on stderr. A traceback,
a stray Python warning, a call running past its time limit or a peak RSS beyond its
bound is a failure, reported with the argv and the mutant's file.
"""

from __future__ import annotations

import contextlib
import csv
import io
import json
import os
import random
import re
import signal
import warnings
from pathlib import Path
from typing import Any, Callable, Iterator, Optional, Sequence

from support import logfactory as lf

CORPUS = Path(__file__).resolve().parents[1] / "fuzz_corpus"  # tests/python/fuzz_corpus
REAL_SEED = CORPUS / "seed_real.jsonl"  # a real CPU training run (tests/python/fuzz_corpus/README.md)
ERROR_LINE_MAX = 2000  # a clean error is one line a person can read, not a dump of the log
# argparse's usage errors: the usage block, then "steptrace[ COMMAND]: error: ..."
_ERROR_LINE = re.compile(r"steptrace( [a-z]+)?: error: ")
_STDERR_OK = re.compile(r"(steptrace( [a-z]+)?: (error|warning): |wrote |usage: |  +\S)")


# --------------------------------------------------------------------------- seeds


def factory_records(rank: int, world: int = 2, n: int = 40) -> list[dict[str, Any]]:
    """A rank's log using every record kind and optional step group the readers know."""
    backends = dict(lf.run_start()["backends"])
    backends["telemetry"] = {"active": ["nvml"], "unavailable": {}, "device": "GPU-fake-0", "power_limit_w": 700.0}
    recs: list[dict[str, Any]] = [lf.run_start(rank=rank, world_size=world, run_id="fuzz-factory", backends=backends,
                                               config={"log_dir": "runs/f", "warmup_steps": 5, "window": 20,
                                                       "cluster_interval": 10})]
    for i in range(n):
        slow = 3.0 if rank == 1 else 0.0
        phases = {"forward": 3.0 + slow, "loss": 0.5, "backward": 5.0, "clip": 0.25, "optimizer": 1.25, "ema": 0.1}
        # the time between steps: evaluation, checkpoints (listed before the step), other
        between: dict[str, Any] = {"other_ms": 0.3 if i else 0.0}
        if i % 10 == 5:
            recs.append(lf.interval("eval", i, 150.0, rank=rank, start_unix_ns=lf.T0_NS + i * 20_000_000))
            between["eval_ms"] = 150.0
        if i % 10 == 8:
            recs.append(lf.interval("checkpoint", i, 400.0 + 900.0 * (i > 20), rank=rank,
                                    start_unix_ns=lf.T0_NS + i * 20_000_000))
            recs.append(lf.interval("other", i, 2.0, rank=rank, inside_step=True,
                                    start_unix_ns=lf.T0_NS + i * 20_000_000 + 5_000_000))
            between["checkpoint_ms"] = 400.0 + 900.0 * (i > 20)
            between["interval_in_step_ms"] = 2.0
        if i % 2:
            between["host"] = {"runq_ms": 0.1 * (i % 5), "runq_span_ms": 40.0}
        recs.append(lf.step(
            i, rank=rank, phases=phases, clock="cuda",
            host_phases_ms={k: v * 0.9 for k, v in phases.items()},
            memory={"allocated_bytes": 2**30 + i * 2**20, "reserved_bytes": 2**31, "peak_bytes": 2**31,
                    "rss_bytes": 2**29, "device_used_bytes": 2**33, "device_total_bytes": 2**34},
            counters={"tensor_active_pct": 40.0, "dram_throughput_pct": 85.0, "sm_occupancy_pct": 50.0,
                      "sm_throughput_pct": 70.0},
            kernels={"compute_ms": 8.0, "nccl_ms": 2.0, "exposed_nccl_ms": 0.5, "idle_ms": 0.4, "count": 120},
            telemetry={"power_w": 600.0, "temp_c": 60.0 + i * 0.1, "sm_clock_mhz": 1980.0},
            hw={"power_w": 600.0 - 50 * rank, "min_power_w": 580.0, "energy_j": 6.0, "max_temp_c": 60.0 + 0.2 * i,
                "sm_clock_mhz": 1980.0, "power_limit_w": 700.0,
                "throttle_reasons": ["sw_power_cap"] if i % 7 == 0 else [], "samples": 1},
            comm={"method": "host", "comm_ms": 2.0, "exposed_ms": 0.5, "compute_ms": 8.0, "collectives": 3},
            meta={"global_step": i, "lr": 1e-3, "loss": 0.5},
            **({"phase_retained_bytes": {"forward": 2**20}} if i == 30 else {}),
            **between,
        ))
        if i == 20:
            recs.append(lf.alert("step_regression", i, rank=rank, unix_ns=lf.T0_NS + i))
        if i == 25:
            recs.append({"kind": "resolved", "rank": rank, "type": "step_regression", "step": 25, "first_step": 20,
                         "repeats": 5, "message": "step 25 is back within the slow-step limit"})
        if i == 28:
            recs.append(lf.alert("slow_checkpoint", i, rank=rank, phase=None, value=1.3, baseline=0.4,
                                 threshold=1.4, message="the checkpoint before step 28 took 1.30 s",
                                 details={"checkpoint_s": 1.3, "median_s": 0.4, "earlier": 2}))
            recs.append(lf.alert("host_contention", i, rank=rank, phase=None, value=8.0, baseline=10.0,
                                 threshold=4.0, message="the training thread waited 8.00 ms for a CPU",
                                 details={"runq_ms": 8.0}))
        if i == 32:
            recs.append(lf.alert("memory_growth", i, rank=rank, phase=None, baseline=None,
                                 message="memory grows 1 MiB/step", details={"bytes_per_step": 2**20}))
            recs.append({"kind": "alert_update", "rank": rank, "type": "memory_growth", "step": 35, "alert_step": 32,
                         "phase": "forward", "message": "it grows in forward"})
        if rank == 0 and i % 10 == 9:
            recs.append({"kind": "cluster", "rank": 0, "step": i, "window": i // 10, "first_step": i - 9,
                         "interval": 10, "world_size": world, "ranks_reporting": world, "method": "host",
                         "median_step_ms": 10.0, "slowest_rank": 1, "slowest_excess_pct": 30.0,
                         "stragglers": [1], "temp_delta_c": {"1": 2.0},
                         "ranks": [{"rank": r, "host": "h", "steps": 10, "step_ms": 10.0 + 3 * r,
                                    "step_p95_ms": 11.0, "data_ms": 1.0, "compute_ms": 8.0 + 3 * r,
                                    "comm_ms": 2.0, "wait_ms": 3.0 - 3 * r, "own_ms": 9.0 + 3 * r,
                                    "straggler_pct": 30.0 * r, "memory_bytes": 2**30} for r in range(world)]})
    recs.append(lf.interval("checkpoint", n, 500.0, rank=rank, start_unix_ns=lf.T0_NS + n * 20_000_000))
    recs.append(lf.run_end(n, rank=rank, goodput=lf.goodput(), device_activity={"kernels": {
        "records": 120 * n, "dropped_records": 0, "top": [
            {"name": "sgemm_128x64", "work": "matmul", "total_ms": 100.0, "count": n},
            {"name": "ncclDevKernel_AllReduce_Sum_f32_RING_LL", "work": "nccl", "total_ms": 40.0, "count": n}]}}))
    return recs


def write_seeds(root: Path) -> dict[str, Path]:
    """The seed logs: the committed real run (one file) and a two-rank factory folder."""
    real = root / "real" / "rank0.jsonl"
    real.parent.mkdir(parents=True)
    real.write_bytes(REAL_SEED.read_bytes())
    for r in range(2):
        lf.write_log(root / "factory" / f"rank{r}.jsonl", factory_records(r))
    return {"real": real, "factory0": root / "factory" / "rank0.jsonl", "factory1": root / "factory" / "rank1.jsonl"}


# --------------------------------------------------------------------------- mutators

#: Values put in place of a field: non-finite, huge, negative zero, wrong types.
ODD_VALUES: list[Any] = [
    1e308, -1e308, 5e-324, 0.0, -0.0, 0, -1, 2**63 - 1, -(2**63), 2**64, 10**30, True, False, None,
    "", "12.5", "nan", "x" * 300, [], [1, 2], [[[]]], {}, {"a": {"b": [None]}}, "\u0000\u202e\n\t\"\\",
    "\U0001f600", -1e-300, 1.5,
]
#: Raw JSON-ish tokens that Python's json dumps cannot write: non-finite and out-of-range numbers.
RAW_TOKENS: list[bytes] = [b"NaN", b"Infinity", b"-Infinity", b"1e309", b"-1e999", b"-0", b"1e-400",
                           b"18446744073709551616", b"-9223372036854775809", b"1" + b"0" * 400, b"0x10",
                           b"01", b"+1", b".5", b"1.", b"true1", b'"\\ud800"', b'"\\u0000"']
_BAD_UTF8 = [b"\xff", b"\xc0\xaf", b"\xed\xa0\x80", b"\xf4\x90\x80\x80", b"\xe2\x82", b"\x80\x80", b"\xfe\xfe"]


def _paths(obj: Any, prefix: tuple = ()) -> Iterator[tuple]:
    """Every (key/index) path into a parsed record."""
    if isinstance(obj, dict):
        for k, v in obj.items():
            yield prefix + (k,)
            yield from _paths(v, prefix + (k,))
    elif isinstance(obj, list):
        for i, v in enumerate(obj):
            yield prefix + (i,)
            yield from _paths(v, prefix + (i,))


def _parent(obj: Any, path: tuple) -> Any:
    for p in path[:-1]:
        obj = obj[p]
    return obj


def _split(data: bytes) -> list[bytes]:
    return data.splitlines(keepends=True)


class Mutator:
    """Seeded mutations of a log's bytes; ``mutate`` returns (operator name, new bytes)."""

    def __init__(self, seed: int) -> None:
        self.rng = random.Random(seed)
        self.ops: list[Callable[[bytes], bytes]] = [
            self.truncate, self.flip_bits, self.set_bytes, self.delete_span, self.duplicate_line, self.swap_lines,
            self.drop_line, self.field_value, self.field_value, self.field_value, self.field_raw, self.field_raw,
            self.drop_field, self.duplicate_key, self.wrong_kind, self.bad_utf8, self.nest_in_field,
            self.deep_line, self.garbage_line, self.splice_lines, self.add_field,
        ]

    def mutate(self, data: bytes) -> tuple[str, bytes]:
        op = self.rng.choice(self.ops)
        return op.__name__, op(data)

    # --- byte level
    def truncate(self, d: bytes) -> bytes:
        return d[: self.rng.randrange(len(d) + 1)]

    def flip_bits(self, d: bytes) -> bytes:
        b = bytearray(d)
        for _ in range(self.rng.randint(1, 8)):
            i = self.rng.randrange(len(b))
            b[i] ^= 1 << self.rng.randrange(8)
        return bytes(b)

    def set_bytes(self, d: bytes) -> bytes:
        b = bytearray(d)
        for _ in range(self.rng.randint(1, 4)):
            b[self.rng.randrange(len(b))] = self.rng.choice(b'{}[]":,\n\\0-e.9 \x00\xff')
        return bytes(b)

    def delete_span(self, d: bytes) -> bytes:
        i = self.rng.randrange(len(d))
        return d[:i] + d[i + self.rng.randint(1, 200):]

    def bad_utf8(self, d: bytes) -> bytes:
        i = self.rng.randrange(len(d))
        return d[:i] + self.rng.choice(_BAD_UTF8) + d[i:]

    # --- line level
    def duplicate_line(self, d: bytes) -> bytes:
        lines = _split(d)
        i = self.rng.randrange(len(lines))
        lines.insert(self.rng.randrange(len(lines) + 1), lines[i])
        return b"".join(lines)

    def swap_lines(self, d: bytes) -> bytes:
        lines = _split(d)
        i, j = self.rng.randrange(len(lines)), self.rng.randrange(len(lines))
        lines[i], lines[j] = lines[j], lines[i]
        return b"".join(lines)

    def drop_line(self, d: bytes) -> bytes:
        lines = _split(d)
        del lines[self.rng.randrange(len(lines))]
        return b"".join(lines)

    def splice_lines(self, d: bytes) -> bytes:
        """Two lines glued (a newline lost) or a line cut in two."""
        lines = _split(d)
        i = self.rng.randrange(len(lines))
        if self.rng.random() < 0.5 and i + 1 < len(lines):
            lines[i] = lines[i].rstrip(b"\n")
        else:
            cut = self.rng.randrange(len(lines[i]) + 1)
            lines[i] = lines[i][:cut] + b"\n" + lines[i][cut:]
        return b"".join(lines)

    def garbage_line(self, d: bytes) -> bytes:
        lines = _split(d)
        junk = bytes(self.rng.randrange(256) for _ in range(self.rng.randint(1, 300)))
        lines.insert(self.rng.randrange(len(lines) + 1), junk + b"\n")
        return b"".join(lines)

    def deep_line(self, d: bytes) -> bytes:
        lines = _split(d)
        depth = self.rng.choice([200, 1000, 1025, 5000, 100_000])
        opener = self.rng.choice([b"[", b'{"a":', b'{"kind":"step","phases_ms":['])
        line = opener * depth if self.rng.random() < 0.5 else b"[" * depth + b"]" * depth
        lines.insert(self.rng.randrange(1, len(lines) + 1), line + b"\n")
        return b"".join(lines)

    # --- record level (parse a line, change a field, write it back)
    def _record_line(self, d: bytes) -> tuple[list[bytes], int, Any]:
        lines = _split(d)
        for _ in range(20):
            i = self.rng.randrange(len(lines))
            try:
                rec = json.loads(lines[i])
            except ValueError:
                continue
            if isinstance(rec, dict):
                return lines, i, rec
        return lines, 0, json.loads(lines[0])

    def _put(self, lines: list[bytes], i: int, text: bytes) -> bytes:
        lines[i] = text + b"\n"
        return b"".join(lines)

    def _pick_path(self, rec: Any) -> tuple:
        paths = list(_paths(rec))
        return self.rng.choice(paths) if paths else ()

    def field_value(self, d: bytes) -> bytes:
        lines, i, rec = self._record_line(d)
        path = self._pick_path(rec)
        if path:
            _parent(rec, path)[path[-1]] = self.rng.choice(ODD_VALUES)
        return self._put(lines, i, json.dumps(rec).encode())

    def field_raw(self, d: bytes) -> bytes:
        """A numeric field replaced by a token json cannot write (NaN, 1e309, huge ints)."""
        lines, i, rec = self._record_line(d)
        marker = "\u0001MARK\u0001"
        path = self._pick_path(rec)
        if path:
            _parent(rec, path)[path[-1]] = marker
        return self._put(lines, i, json.dumps(rec).encode().replace(json.dumps(marker).encode(),
                                                                     self.rng.choice(RAW_TOKENS)))

    def drop_field(self, d: bytes) -> bytes:
        lines, i, rec = self._record_line(d)
        path = self._pick_path(rec)
        if path:
            del _parent(rec, path)[path[-1]]
        return self._put(lines, i, json.dumps(rec).encode())

    def add_field(self, d: bytes) -> bytes:
        lines, i, rec = self._record_line(d)
        dicts = [rec] + [_parent(rec, p + ("",)) for p in _paths(rec) if isinstance(_parent(rec, p + ("",)), dict)]
        target = self.rng.choice(dicts)
        target[self.rng.choice(["x", "step", "phases_ms", "kind", "rank", "", "forward", "step_ms"])] = (
            self.rng.choice(ODD_VALUES))
        return self._put(lines, i, json.dumps(rec).encode())

    def duplicate_key(self, d: bytes) -> bytes:
        lines, i, rec = self._record_line(d)
        key = self.rng.choice(list(rec) or ["kind"])
        value = json.dumps(self.rng.choice(ODD_VALUES + ["step", "run_start", "alert"])).encode()
        text = json.dumps(rec).encode()
        if self.rng.random() < 0.5:
            text = text[:-1] + b',"' + key.encode() + b'":' + value + b"}"
        else:
            text = b'{"' + key.encode() + b'":' + value + b"," + text[1:]
        return self._put(lines, i, text)

    def wrong_kind(self, d: bytes) -> bytes:
        lines, i, rec = self._record_line(d)
        rec["kind"] = self.rng.choice(["step", "alert", "run_start", "run_end", "cluster", "resolved", "alert_update",
                                       "mystery", "", None, 3, ["step"], {"k": 1}])
        return self._put(lines, i, json.dumps(rec).encode())

    def nest_in_field(self, d: bytes) -> bytes:
        lines, i, rec = self._record_line(d)
        path = self._pick_path(rec)
        depth = self.rng.choice([50, 500, 990, 1023, 1100])
        text = json.dumps(rec).encode()
        if path:
            marker = "\u0001MARK\u0001"
            _parent(rec, path)[path[-1]] = marker
            text = json.dumps(rec).encode().replace(json.dumps(marker).encode(), b"[" * depth + b"]" * depth)
        return self._put(lines, i, text)


# --------------------------------------------------------------------------- whole-file mutants

def special_files(rng: random.Random) -> list[tuple[str, bytes]]:
    """Files that are not mutated logs at all: empty, blank, binary garbage, NULs."""
    return [
        ("empty", b""), ("newline", b"\n"), ("blank", b" \n\t\n\r\n"), ("nul", b"\x00" * 4096),
        ("garbage", bytes(rng.randrange(256) for _ in range(4096))),
        ("garbage_lines", b"\n".join(bytes(rng.randrange(256) for _ in range(80)) for _ in range(50))),
        ("bom", b"\xef\xbb\xbf" + REAL_SEED.read_bytes()),
        ("utf16", REAL_SEED.read_text().encode("utf-16")),
        ("crlf", REAL_SEED.read_bytes().replace(b"\n", b"\r\n")),
        ("no_newlines", REAL_SEED.read_bytes().replace(b"\n", b"")),
        ("only_header", _split(REAL_SEED.read_bytes())[0]),
        ("header_no_newline", _split(REAL_SEED.read_bytes())[0].rstrip(b"\n")),
        ("json_array", b"[" + b",".join(l.rstrip(b"\n") for l in _split(REAL_SEED.read_bytes())) + b"]\n"),
        ("deep_header", b"[" * 100_000 + b"\n"),
        ("deep_obj_header", b'{"kind":' * 100_000 + b"\n"),
    ]


def long_line_files(seed: bytes, mb: int = 24 << 20) -> list[tuple[str, bytes, int]]:
    """(name, content, line bytes): a log with one line of about ``mb`` bytes inside or at
    its end (beyond the reader's MAX_LINE_BYTES, 16 MiB, such a line is skipped unread)."""
    lines = _split(seed)
    head, body = lines[0], b"".join(lines[1:])
    step = json.loads(lines[1])
    out = []

    def with_line(name: str, line: bytes, newline: bool = True, at_end: bool = False) -> None:
        data = head + (body + line if at_end else line + (b"\n" if newline else b"") + body)
        out.append((name, data, len(line)))

    big_name = dict(step, phases_ms={"forward": 1.0, "p" * mb: 2.0})
    with_line("long_phase_name", json.dumps(big_name).encode())
    with_line("long_message", json.dumps(lf.alert("stall", 3, message="m" * mb)).encode())
    many = dict(step, phases_ms={f"phase{i}": 0.5 for i in range(mb // 20)})
    with_line("many_phases", json.dumps(many).encode())
    with_line("long_junk", b"z" * mb)
    with_line("long_spaces", b" " * mb)
    with_line("long_array", b'{"kind":"step","step":1,"phases_ms":[' + b"1.5," * (mb // 4) + b"1]}")
    with_line("long_truncated_tail", b'{"kind":"step","message":"' + b"q" * mb, newline=False, at_end=True)
    with_line("long_header_schema", b"", newline=False)  # placeholder replaced below
    big_schema = json.dumps(dict(json.loads(head), schema="s" * mb)).encode() + b"\n"
    out[-1] = ("long_header_schema", big_schema + body, len(big_schema))
    return out


def make_mutant(i: int, seeds: dict[str, Path], root: Path) -> tuple[str, str, Path]:
    """Mutant ``i`` (seeded by i): of the real log (a file), or of one rank of the
    two-rank factory folder (a folder with the other rank intact). (operator, seed, path)."""
    which = ("real", "factory0", "factory1")[i % 3]
    op, data = Mutator(i).mutate(seeds[which].read_bytes())
    if which == "real":
        path = root / f"m{i}.jsonl"
        path.write_bytes(data)
        return op, which, path
    folder = root / f"m{i}"
    folder.mkdir()
    other = seeds["factory1" if which == "factory0" else "factory0"]
    (folder / seeds[which].name).write_bytes(data)
    (folder / other.name).write_bytes(other.read_bytes())
    return op, which, folder


# --------------------------------------------------------------------------- the oracle


class Hang(BaseException):
    """A call ran past its time limit (BaseException: no ``except Exception`` swallows it)."""


@contextlib.contextmanager
def time_limit(seconds: float) -> Iterator[None]:
    def fire(signum: int, frame: Any) -> None:
        raise Hang(f"still running after {seconds:g} s")

    old = signal.signal(signal.SIGALRM, fire)
    signal.setitimer(signal.ITIMER_REAL, seconds)
    try:
        yield
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, old)


def _vm(field: str) -> int:
    with open("/proc/self/status") as fh:
        for line in fh:
            if line.startswith(field):
                return int(line.split()[1]) * 1024
    return 0


@contextlib.contextmanager
def peak_rss() -> Iterator[list[int]]:
    """Yields a list that receives the peak RSS growth (bytes) of the block: the kernel's
    high-water mark (VmHWM) reset through /proc/self/clear_refs; where that cannot be
    written, resource.getrusage's lifetime maximum (then only growth past it is seen)."""
    import resource

    out: list[int] = []
    try:
        with open("/proc/self/clear_refs", "w") as fh:
            fh.write("5")
        base, hwm = _vm("VmRSS:"), True
    except OSError:
        base, hwm = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024, False
    yield out
    peak = _vm("VmHWM:") if hwm else resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    out.append(max(0, peak - base))


def strict_json(text: str) -> Any:
    def bad(name: str) -> Any:
        raise ValueError(f"{name} in output")
    return json.loads(text, parse_constant=bad)


class Failure(AssertionError):
    pass


class Oracle:
    """Runs one mutant through the API and the CLI and raises :class:`Failure` on a bug."""

    def __init__(self, workdir: Path, baseline: Path, time_limit_s: float = 20.0) -> None:
        self.workdir = workdir
        self.baseline = baseline  # a good log: the other side of compare
        self.limit = time_limit_s
        self.calls = 0
        self.nesting = False  # whether an exported trace must nest (true for correct logs)

    def _fail(self, what: str, detail: str) -> None:
        raise Failure(f"{what}: {detail}")

    def api(self, path: Path, *, validate: bool = True, load: bool = True) -> dict[str, Any]:
        """The reader and steptrace.load; returns what read() made of the log."""
        import steptrace
        from steptrace import SteptraceError

        result: dict[str, Any] = {}
        calls: list[tuple[str, Callable[[], Any]]] = [
            ("read", lambda: list(steptrace.read(path))),
            ("read(skip_bad)", lambda: list(steptrace.read(path, skip_bad=True))),
        ]
        if validate:
            calls.append(("read(validate, skip_bad)", lambda: list(steptrace.read(path, validate=True, skip_bad=True))))

        def frames() -> Any:
            run = steptrace.load(path, skip_bad=True)
            repr(run)
            run.steps, run.alerts, run.summary(), run.phase_columns
            if os.path.isdir(path):
                run.per_rank
            return run

        if load:
            calls.append(("load", frames))
        for name, call in calls:
            self.calls += 1
            with warnings.catch_warnings(record=True) as caught:
                warnings.simplefilter("always")
                try:
                    with time_limit(self.limit):
                        result[name] = call()
                except SteptraceError as exc:
                    result[name] = exc
                    msg = str(exc)
                    if not msg or "\n" in msg.strip() or len(msg) > ERROR_LINE_MAX:
                        self._fail(name, f"unclear error message ({len(msg)} chars): {msg[:300]!r}")
                except Hang as exc:
                    self._fail(name, str(exc))
                except Exception as exc:  # noqa: BLE001 - the bug the fuzzer looks for
                    import traceback

                    self._fail(name, "raised " + "".join(traceback.format_exception(exc))[-3000:])
            from steptrace.analysis.reader import ReaderWarning

            stray = [w for w in caught if not issubclass(w.category, ReaderWarning)]
            if stray:
                self._fail(name, f"stray warning {stray[0].category.__name__}: {stray[0].message}")
        return result

    def cli(self, argv: Sequence[str]) -> tuple[int, str, str]:
        """``steptrace.cli.main(argv)`` in-process; checks the exit status and stderr."""
        from steptrace.cli import main

        self.calls += 1
        out, err = io.StringIO(), io.StringIO()
        where = " ".join(map(str, argv))
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            try:
                with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err), time_limit(self.limit):
                    rc = main([str(a) for a in argv])
            except Hang as exc:
                self._fail(where, str(exc))
            except SystemExit as exc:
                rc = exc.code if isinstance(exc.code, int) else 2
                if rc == 0:
                    self._fail(where, "SystemExit(0) from main()")
            except BaseException as exc:  # noqa: BLE001
                import traceback

                self._fail(where, "raised " + "".join(traceback.format_exception(exc))[-3000:])
        if caught:
            self._fail(where, f"stray warning {caught[0].category.__name__}: {caught[0].message}")
        text = err.getvalue()
        lines = text.splitlines()
        for line in lines:
            if not _STDERR_OK.match(line):
                self._fail(where, f"stderr line that is not a steptrace message: {line[:300]!r}")
            if len(line) > ERROR_LINE_MAX and _ERROR_LINE.match(line):
                self._fail(where, f"error line of {len(line)} chars: {line[:300]!r}")
        if rc not in (0, 1, 2):
            self._fail(where, f"exit status {rc}")
        if rc == 2:
            if not lines or not _ERROR_LINE.match(lines[-1]):
                self._fail(where, f"exit 2 without an error line: {text[-300:]!r}")
            if sum(bool(_ERROR_LINE.match(line)) for line in lines) != 1:
                self._fail(where, f"more than one error line: {text[-600:]!r}")
        elif any(_ERROR_LINE.match(line) for line in lines):
            self._fail(where, f"exit {rc} with an error line")
        return rc, out.getvalue(), text

    def commands(self, path: Path, tag: str, heavy: bool = False, compare: bool = True) -> dict[str, int]:
        """Every log-reading subcommand on ``path``; checks their outputs; returns exit codes."""
        w = self.workdir
        codes: dict[str, int] = {}

        rc, out, _ = self.cli(["summary", path, "--no-progress"])
        codes["summary"] = rc
        if rc == 0 and not out.strip():
            self._fail("summary", "exit 0 with no output")
        rc, out, _ = self.cli(["summary", path, "--json", "--skip-bad"])
        codes["summary --json"] = rc
        if rc == 0:
            try:
                doc = strict_json(out)
            except ValueError as exc:
                self._fail("summary --json", f"not strict JSON: {exc}")
            if not isinstance(doc, dict):
                self._fail("summary --json", "not an object")
        for a, b in ((self.baseline, path), (path, self.baseline)) if compare else ():
            rc, out, _ = self.cli(["compare", a, b, "--json", "--skip-bad"])
            codes[f"compare {'new' if b == path else 'base'}"] = rc
            if rc in (0, 1):
                try:
                    strict_json(out)
                except ValueError as exc:
                    self._fail("compare --json", f"not strict JSON: {exc}")
        if compare:
            rc, _, _ = self.cli(["compare", path, path, "--skip-bad"])
            codes["compare self"] = rc
        chrome = w / f"{tag}.trace.json"
        rc, _, _ = self.cli(["export", path, "--format", "chrome", "-o", chrome, "--skip-bad"])
        codes["export chrome"] = rc
        if rc == 0:
            try:
                lf.check_chrome_trace(strict_json(chrome.read_text(encoding="utf-8")))
            except (ValueError, AssertionError) as exc:
                # a corrupt start time can make a log's steps overlap; the trace shows them as
                # they are (the seeds and the corpus check that correct logs nest)
                if self.nesting or " overlaps " not in str(exc):
                    self._fail("export chrome", f"bad trace: {str(exc)[:500]}")
        table = w / f"{tag}.csv"
        rc, _, _ = self.cli(["export", path, "--format", "csv", "-o", table, "--skip-bad"])
        codes["export csv"] = rc
        if rc == 0:
            csv.field_size_limit(2**31 - 1)  # a 24 MiB phase name is one header cell
            with open(table, newline="", encoding="utf-8") as fh:
                rows = list(csv.reader(fh))
            if not rows or len({len(r) for r in rows}) != 1:
                self._fail("export csv", f"ragged CSV: row lengths {sorted({len(r) for r in rows})}")
        rc, out, _ = self.cli(["cluster", path, "--json", "--skip-bad"])
        codes["cluster --json"] = rc
        if rc == 0:
            try:
                strict_json(out)
            except ValueError as exc:
                self._fail("cluster --json", f"not strict JSON: {exc}")
        rc, _, _ = self.cli(["cluster", path, "--interval", "7"])
        codes["cluster"] = rc
        if heavy:
            png = w / f"{tag}.png"
            rc, _, _ = self.cli(["plot", path, "-o", png, "--skip-bad"])
            codes["plot"] = rc
            if rc == 0 and not png.read_bytes().startswith(b"\x89PNG"):
                self._fail("plot", "exit 0 but no PNG")
            html = w / f"{tag}.html"
            rc, _, _ = self.cli(["report", path, "-o", html, "--skip-bad"])
            codes["report"] = rc
            if rc == 0 and "</html>" not in html.read_text(encoding="utf-8")[-200:]:
                self._fail("report", "exit 0 but no complete HTML")
        return codes

    def check(self, path: Path, tag: str, heavy: bool = False, validate: bool = True, compare: bool = True,
              load: bool = True) -> dict[str, Any]:
        """The API and every subcommand on one mutant; cross-checks them. ``heavy`` adds plot
        and report; ``validate``, ``compare`` and ``load`` the slower checks."""
        from steptrace import SteptraceError

        api = self.api(path, validate=validate, load=load)
        codes = self.commands(path, tag, heavy, compare)
        strict_ok = not isinstance(api["read"], SteptraceError)
        lenient_ok = not isinstance(api["read(skip_bad)"], SteptraceError)
        if not lenient_ok:  # a log the reader refuses: every command must refuse it
            for cmd in ("summary --json", "export chrome", "export csv", "cluster --json"):
                if codes[cmd] != 2:
                    self._fail(cmd, f"exit {codes[cmd]} on a log read() refuses ({api['read(skip_bad)']})")
        if strict_ok and codes["summary"] != 0:  # anything read() takes, summary summarizes
            self._fail("summary", f"exit {codes['summary']} on a log read() takes")
        if lenient_ok and codes["summary --json"] != 0:
            self._fail("summary --json --skip-bad", f"exit {codes['summary --json']} on a log read() takes")
        return {"api": api, "codes": codes}


def expected_after_truncation(original: bytes, cut: int) -> Optional[list[dict[str, Any]]]:
    """The records read() must give for ``original[:cut]``: the whole lines before the cut
    (and the cut line when it is still a whole record), None when no record survives."""
    records = []
    pos = 0
    for line in _split(original):
        end = pos + len(line)
        if end <= cut:
            records.append(json.loads(line))
        else:
            part = original[pos:cut]
            try:
                rec = json.loads(part)
                if isinstance(rec, dict) and "kind" in rec:
                    records.append(rec)
            except ValueError:
                pass
            break
        pos = end
    return records or None


__all__ = ["make_mutant", "Mutator", "Oracle", "Failure", "write_seeds", "special_files", "long_line_files", "peak_rss",
           "time_limit", "expected_after_truncation", "CORPUS", "REAL_SEED", "Hang", "strict_json"]

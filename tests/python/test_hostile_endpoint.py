"""Hostile clients of the metrics endpoint and of the Pushgateway push, over loopback.

Each case runs a real Profiler in a training loop (a child process unless said
otherwise, so that its memory, descriptors, close() time and SIGTERM are its own),
attacks it with a bounded number of sockets for a bounded time, stops by itself, and
asserts on the trainer: peak RSS growth, descriptors, steps still recorded, its own
open() still working, scrape latency, close() time, run_end written. The numbers are
issue 50's: a 64 MiB request grows RSS by < 16 MiB; a scrape answers within 2 s beside 60
idle connections; close() takes < 3 s beside any client; no descriptor is used beyond the
connection cap (docs/prometheus-grafana.md, "Exposure and limits").
"""

from __future__ import annotations

import contextlib
import json
import os
import queue
import signal
import socket
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
from pathlib import Path
from typing import Iterator

import pytest

import steptrace

MiB = 1 << 20
ATTACK_BYTES = 64 * MiB
CONNECTION_CAP = 32  # the documented connection cap (metrics_http.hpp EndpointLimits::max_connections)
CHILD_TIMEOUT_S = 60.0

# The trainer: a Profiler with the endpoint on, stepping until told to close. Each step
# opens a file, as a loop's checkpoint or DataLoader worker would; it counts the failures.
# Commands on stdin, one JSON line each: {"cmd": "status"} and {"cmd": "close"}.
TRAINER = r"""
import json, os, queue, resource, sys, threading, time
opts = json.loads(sys.argv[1])
if opts.get("nofile"):
    hard = resource.getrlimit(resource.RLIMIT_NOFILE)[1]
    resource.setrlimit(resource.RLIMIT_NOFILE, (opts["nofile"], hard))
import steptrace

commands = queue.Queue()
def read_commands():
    for line in sys.stdin:
        commands.put(json.loads(line))
threading.Thread(target=read_commands, daemon=True).start()

def say(**fields):
    print(json.dumps(fields), flush=True)

prof = steptrace.Profiler(opts["log_dir"], metrics_port=0, **opts.get("kw", {}))
probe = os.path.join(opts["log_dir"], "probe")
steps = open_errors = 0
last_open_error = ""
say(port=prof.metrics_port, pid=os.getpid())
while True:
    try:
        cmd = commands.get_nowait()
    except queue.Empty:
        cmd = None
    if cmd is not None and cmd["cmd"] == "close":
        t0 = time.monotonic()
        prof.close()
        say(close_s=time.monotonic() - t0, steps=steps, open_errors=open_errors)
        break
    if cmd is not None and cmd["cmd"] == "status":
        say(steps=steps, open_errors=open_errors, last_open_error=last_open_error)
    with prof.step():
        with prof.phase("forward"):
            time.sleep(0.002)  # the step's work
        with prof.phase("io"):
            try:
                with open(probe, "w") as f:
                    f.write("x")
            except OSError as e:
                open_errors += 1
                last_open_error = str(e)
    steps += 1
"""


class Trainer:
    """The child trainer: its port, pid, status, memory, descriptors and close()."""

    def __init__(self, log_dir: Path, nofile: int = 0, **kw) -> None:
        self.log_dir = log_dir
        self.proc = subprocess.Popen(
            [sys.executable, "-c", TRAINER, json.dumps({"log_dir": str(log_dir), "nofile": nofile, "kw": kw})],
            stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
            start_new_session=True)
        self.lines: queue.Queue = queue.Queue()
        self.stderr: list[str] = []
        threading.Thread(target=self._pump, args=(self.proc.stdout, self.lines.put), daemon=True).start()
        threading.Thread(target=self._pump, args=(self.proc.stderr, self.stderr.append), daemon=True).start()
        first = self.read()
        self.port, self.pid = first["port"], first["pid"]
        assert self.port > 0, f"the endpoint did not start: {''.join(self.stderr)}"
        self.wait_steps(5)

    @staticmethod
    def _pump(stream, put) -> None:
        for line in stream:
            put(line)

    def read(self, timeout_s: float = CHILD_TIMEOUT_S) -> dict:
        try:
            return json.loads(self.lines.get(timeout=timeout_s))
        except queue.Empty:
            pytest.fail(f"the trainer said nothing for {timeout_s} s; stderr:\n{''.join(self.stderr)}")

    def command(self, cmd: str) -> None:
        self.proc.stdin.write(json.dumps({"cmd": cmd}) + "\n")
        self.proc.stdin.flush()

    def status(self) -> dict:
        self.command("status")
        return self.read()

    def wait_steps(self, n: int) -> dict:
        deadline = time.monotonic() + CHILD_TIMEOUT_S
        while time.monotonic() < deadline:
            s = self.status()
            if s["steps"] >= n:
                return s
        pytest.fail(f"the trainer did not reach step {n}")

    def peak_rss_bytes(self) -> int:
        for line in Path(f"/proc/{self.pid}/status").read_text().splitlines():
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) * 1024
        raise AssertionError("no VmHWM")

    def sockets(self) -> int:
        """The trainer's socket descriptors: the endpoint's connections, without the file the
        loop itself opens each step (which made a count of every descriptor one too many
        whenever it was sampled inside that open)."""
        count = 0
        for fd in os.listdir(f"/proc/{self.pid}/fd"):
            try:
                count += os.readlink(f"/proc/{self.pid}/fd/{fd}").startswith("socket:")
            except OSError:
                pass  # closed between the listing and the read
        return count

    def close(self) -> dict:
        self.command("close")
        out = self.read()
        self.proc.wait(timeout=CHILD_TIMEOUT_S)
        return out

    def records(self) -> list[dict]:
        return list(steptrace.read(self.log_dir / "rank0.jsonl", validate=True))

    def kill(self) -> None:
        if self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait()


@pytest.fixture
def trainer(tmp_path):
    started: list[Trainer] = []

    def start(**kw) -> Trainer:
        t = Trainer(tmp_path / f"run{len(started)}", **kw)
        started.append(t)
        return t

    yield start
    for t in started:
        t.kill()


def scrape(port: int, timeout_s: float = 2.0, headers: dict | None = None, method: str = "GET"):
    """(status, headers, body) of one request; raises on a timeout."""
    req = urllib.request.Request(f"http://127.0.0.1:{port}/metrics", headers=headers or {}, method=method)
    try:
        with urllib.request.urlopen(req, timeout=timeout_s) as r:
            return r.status, r.headers, r.read()
    except urllib.error.HTTPError as e:
        return e.code, e.headers, e.read()


def timed_scrape(port: int, limit_s: float = 2.0) -> float:
    t0 = time.monotonic()
    try:
        status, _, body = scrape(port, timeout_s=limit_s + 1.0)
    except OSError as e:
        pytest.fail(f"a scrape failed after {time.monotonic() - t0:.1f} s: {e!r}")
    took = time.monotonic() - t0
    assert status == 200 and b"steptrace_steps_total" in body
    return took


def connect(port: int, timeout_s: float = 2.0) -> socket.socket:
    s = socket.create_connection(("127.0.0.1", port), timeout=timeout_s)
    return s


def closed_by_peer(s: socket.socket, wait_s: float = 0.0) -> bool:
    """True once the server closed (or answered and closed) the connection."""
    s.settimeout(wait_s if wait_s > 0 else 0.0001)
    try:
        while True:
            data = s.recv(65536)
            if not data:
                return True
    except (socket.timeout, BlockingIOError):
        return False
    except OSError:  # reset
        return True


def send_huge(port: int, head: bytes, chunk: bytes, total: int, tail: bytes = b"", time_limit_s: float = 20.0) -> int:
    """Sends head, then chunk until `total` bytes or the server stops taking them; the
    bytes sent."""
    s = connect(port)
    s.settimeout(3.0)
    sent = 0
    deadline = time.monotonic() + time_limit_s
    try:
        s.sendall(head)
        while sent < total and time.monotonic() < deadline:
            s.sendall(chunk)
            sent += len(chunk)
        s.sendall(tail)
        s.settimeout(3.0)
        while s.recv(65536):
            pass
    except OSError:  # reset, broken pipe or the server stopped reading: what a cap does
        pass
    finally:
        s.close()
    return sent


# ---- size ---------------------------------------------------------------------------

ONE_MIB_CHUNK = b"%x\r\n" % MiB + b"a" * MiB + b"\r\n"
OVERSIZED = {
    "header_line": (b"GET /metrics HTTP/1.1\r\nHost: x\r\nX-Big: ", b"a" * MiB, b"\r\n\r\n"),
    "post_body": (b"POST /metrics HTTP/1.1\r\nHost: x\r\nContent-Length: %d\r\n\r\n" % ATTACK_BYTES, b"a" * MiB, b""),
    "get_body": (b"GET /metrics HTTP/1.1\r\nHost: x\r\nContent-Length: %d\r\n\r\n" % ATTACK_BYTES, b"a" * MiB, b""),
    "unfinished_chunked_post": (b"POST /metrics HTTP/1.1\r\nHost: x\r\nTransfer-Encoding: chunked\r\n\r\n",
                                ONE_MIB_CHUNK, b""),
    "unfinished_chunked_get": (b"GET /metrics HTTP/1.1\r\nHost: x\r\nTransfer-Encoding: chunked\r\n\r\n",
                               ONE_MIB_CHUNK, b""),
}


@pytest.mark.parametrize("kind", list(OVERSIZED))
def test_a_64_mib_request_does_not_grow_the_trainer(trainer, kind):
    t = trainer()
    timed_scrape(t.port)  # the server's own first-use allocations before the baseline
    before = t.peak_rss_bytes()
    head, chunk, tail = OVERSIZED[kind]
    send_huge(t.port, head, chunk, ATTACK_BYTES, tail)
    grown = t.peak_rss_bytes() - before
    assert grown < 16 * MiB, f"a 64 MiB {kind} grew the trainer's peak RSS by {grown / MiB:.1f} MiB"
    s = t.status()
    t.wait_steps(s["steps"] + 5)  # the loop goes on
    timed_scrape(t.port)  # and so does the endpoint
    out = t.close()
    assert out["open_errors"] == 0
    assert not [r for r in t.records() if r["kind"] == "alert" and r["type"] == "memory_growth"]


# ---- time ---------------------------------------------------------------------------

def drip(port: int, stop: threading.Event, every_s: float, result: dict, time_limit_s: float = 15.0) -> None:
    """A slowloris client: a request line, then one header line every `every_s`, never
    the blank line. result["cut_after_s"]: when the server closed it (None: it never did
    within time_limit_s or before `stop`)."""
    result["cut_after_s"] = None
    s = connect(port)
    t0 = time.monotonic()
    try:
        s.sendall(b"GET /metrics HTTP/1.1\r\nHost: x\r\n")
        i = 0
        while not stop.is_set() and time.monotonic() - t0 < time_limit_s:
            if closed_by_peer(s, wait_s=every_s):
                result["cut_after_s"] = time.monotonic() - t0
                return
            s.sendall(b"X-Drip-%d: %s\r\n" % (i, b"y" * 16))
            i += 1
    except OSError:
        result["cut_after_s"] = time.monotonic() - t0
    finally:
        s.close()


def test_slowloris_clients_neither_hold_a_worker_nor_stop_scrapes(trainer):
    t = trainer()
    stop = threading.Event()
    results = [{} for _ in range(4)]  # twice the workers
    threads = [threading.Thread(target=drip, args=(t.port, stop, 1.0, r)) for r in results]
    for th in threads:
        th.start()
    try:
        took = [timed_scrape(t.port) for _ in range(3)]
        assert max(took) < 2.0, f"scrapes beside 4 dripping clients took {took}"
    finally:
        for th in threads:
            th.join(timeout=20)
        stop.set()
    cut = [r["cut_after_s"] for r in results]
    # the whole-request deadline (5 s) cuts each of them, however often it sends
    assert all(c is not None and c < 8.0 for c in cut), f"dripping clients cut after {cut} s"
    s = t.close()
    assert s["open_errors"] == 0


def test_a_scrape_answers_within_2_s_beside_60_idle_connections(trainer):
    t = trainer()
    idle = []
    try:
        for _ in range(60):
            try:
                idle.append(connect(t.port))
            except OSError:
                pass  # a connection the cap refused: fine
        took = [timed_scrape(t.port) for _ in range(3)]
        assert max(took) < 2.0, f"scrapes beside 60 idle connections took {took}"
    finally:
        for s in idle:
            s.close()
    t.close()


def test_an_idle_connection_flood_under_a_low_descriptor_limit(trainer):
    # RLIMIT_NOFILE 256 and 400 connections that never send: the trainer's own open()
    # goes on, and the endpoint never holds more than its cap of descriptors.
    t = trainer(nofile=256)
    baseline = t.sockets()
    most = baseline
    conns = []
    try:
        for i in range(400):
            try:
                conns.append(connect(t.port, timeout_s=1.0))
            except OSError:
                pass  # refused or dropped by the backlog: fine
            if i % 20 == 0:
                most = max(most, t.sockets())
        most = max(most, t.sockets())
        took = timed_scrape(t.port)
        assert took < 2.0
        s = t.status()
        t.wait_steps(s["steps"] + 5)
        most = max(most, t.sockets())
        status = t.status()
    finally:
        for c in conns:
            c.close()
    assert status["open_errors"] == 0, f"the loop's open() failed: {status['last_open_error']}"
    assert most - baseline <= CONNECTION_CAP, (
        f"the endpoint used {most - baseline} sockets beyond the trainer's {baseline} (cap {CONNECTION_CAP})")
    assert t.close()["open_errors"] == 0


# ---- what a request can ask for -----------------------------------------------------

def test_only_get_and_head_and_never_a_range(tmp_path, monkeypatch):
    with steptrace.Profiler(tmp_path / "run", metrics_port=0, run_id="methods") as prof:
        with prof.step():
            pass
        prof.flush()
        status, headers, full = scrape(prof.metrics_port)
        assert status == 200 and full.startswith(b"# HELP")
        for method in ("POST", "PUT", "DELETE", "PATCH", "OPTIONS"):
            status, headers, _ = scrape(prof.metrics_port, method=method)
            assert status == 405, method
            assert headers["Allow"] == "GET, HEAD"
        status, headers, body = scrape(prof.metrics_port, method="HEAD")
        assert status == 200 and body == b""
        # 2,000 overlapping ranges in a 6 KB header: the whole text, once
        many = "bytes=" + ",".join(["0-"] * 2000)
        for rng in (many, "bytes=0-9", "bytes=-5"):
            status, headers, body = scrape(prof.metrics_port, headers={"Range": rng})
            assert status == 200, rng[:20]
            assert "Content-Range" not in headers
            assert body.startswith(b"# HELP") and len(body) < 2 * len(full)


def test_a_second_profiler_on_the_same_port_gets_the_clear_error(tmp_path, monkeypatch, capfd):
    monkeypatch.delenv("LOCAL_RANK", raising=False)
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    with steptrace.Profiler(tmp_path / "a", metrics_port=port) as first:
        assert first.metrics_port == port
        with steptrace.Profiler(tmp_path / "b", metrics_port=port) as second:
            assert second.metrics_port == -1
        err = capfd.readouterr().err
        assert f"could not bind 127.0.0.1:{port}" in err and "in use" in err
        assert timed_scrape(port) < 2.0  # the first one still serves its own run
    start = json.loads((tmp_path / "b" / "rank0.jsonl").read_text().splitlines()[0])
    assert start["metrics"]["port"] is None
    assert "in use" in start["metrics"]["error"]


# ---- shutdown -----------------------------------------------------------------------

@contextlib.contextmanager
def a_dripping_client(port: int) -> Iterator[None]:
    """A client dripping its request (one byte every 0.25 s) for the body of the block,
    already inside its request when the block starts; stopped and joined after it."""
    stop = threading.Event()
    th = threading.Thread(target=drip, args=(port, stop, 0.25, {}))
    th.start()
    try:
        time.sleep(0.5)  # the client is inside its request: the attack, not synchronization
        yield
    finally:
        stop.set()
        th.join(timeout=20)


def assert_sigterm_ends_the_run_promptly(t) -> None:  # type: ignore[no-untyped-def]
    """SIGTERM to the trainer: it exits by the signal within 3 s, run_end written."""
    t0 = time.monotonic()
    t.proc.send_signal(signal.SIGTERM)
    try:
        rc = t.proc.wait(timeout=20)
    except subprocess.TimeoutExpired:
        rc = None
    took = time.monotonic() - t0
    assert rc == -signal.SIGTERM and took < 3.0, f"after SIGTERM: rc {rc} after {took:.1f} s"
    end = t.records()[-1]
    assert end["kind"] == "run_end" and end["reason"] == "signal"


def test_close_does_not_wait_on_a_dripping_client(trainer):
    t = trainer()
    with a_dripping_client(t.port):
        out = t.close()
    assert out["close_s"] < 3.0, f"close() took {out['close_s']:.1f} s beside a dripping client"
    assert t.records()[-1]["kind"] == "run_end"


def test_sigterm_ends_the_run_promptly_beside_a_dripping_client(trainer):
    t = trainer()
    with a_dripping_client(t.port):
        assert_sigterm_ends_the_run_promptly(t)


class DribblingGateway:
    """A Pushgateway stand-in that reads the request, then answers one byte a second."""

    def __init__(self) -> None:
        self.sock = socket.socket()
        self.sock.bind(("127.0.0.1", 0))
        self.sock.listen(4)
        self.sock.settimeout(0.2)
        self.port = self.sock.getsockname()[1]
        self.stop = threading.Event()
        self.requests = 0
        self.thread = threading.Thread(target=self._serve, daemon=True)
        self.thread.start()

    def _serve(self) -> None:
        reply = b"HTTP/1.1 200 OK\r\nContent-Length: 0\r\n\r\n"
        while not self.stop.is_set():
            try:
                conn, _ = self.sock.accept()
            except socket.timeout:
                continue
            self.requests += 1
            with conn:
                conn.settimeout(2.0)
                try:
                    conn.recv(65536)
                    for i in range(len(reply)):
                        if self.stop.wait(1.0):
                            break
                        conn.sendall(reply[i:i + 1])
                except OSError:
                    pass

    def close(self) -> None:
        self.stop.set()
        self.thread.join(timeout=5)
        self.sock.close()


@pytest.fixture
def gateway():
    g = DribblingGateway()
    yield g
    g.close()


def test_close_does_not_wait_on_a_dribbling_pushgateway(trainer, gateway):
    t = trainer(metrics_pushgateway=f"http://127.0.0.1:{gateway.port}")
    out = t.close()
    assert gateway.requests == 1
    assert out["close_s"] < 3.0, f"close() took {out['close_s']:.1f} s beside a dribbling Pushgateway"
    assert t.records()[-1]["kind"] == "run_end"
    assert "Pushgateway push failed" in "".join(t.stderr)


def test_sigterm_ends_the_run_promptly_beside_a_dribbling_pushgateway(trainer, gateway):
    t = trainer(metrics_pushgateway=f"http://127.0.0.1:{gateway.port}")
    assert_sigterm_ends_the_run_promptly(t)

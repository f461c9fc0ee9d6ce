"""The KV digest protocol: a decode worker asks the prefill worker rank it read from for the
digests of one prefill request's kernel pages, over ZeroMQ, one JSON message each way.

Request ``{"op": "digest", "req": prefill request id}``; reply ``{"req": id, "state":
"ready", "groups": {group: {"pages": base64 int64[], "lanes": base64 uint64[n, 2]}}}``,
``{"req": id, "state": "pending"}`` (not computed yet: ask again), ``{"req": id, "state":
"unknown"}`` or ``{"error": text}``. The service answers anything it cannot use with an
error and keeps serving (requests are capped in size); on the asking side every reply that
is not this protocol raises :class:`DigestAskFailed`.

A decode rank of a larger TP size reads part ``j`` of ``r`` of every region of a page; it asks
with ``"split": {group: [r, j, regions]}`` and gets, for those groups, each page's lanes of
that part (the prefill keeps its lanes per cell, ``connector.kv_digest``); a group the prefill
cannot cut that way comes back under ``"unsplit": {group: why}``, and the decode logs those
reads as unverified.

Each prefill worker rank listens on the engine's digest port base (carried in the lease
value, ``digest_port``) plus its tensor-parallel rank; the base is the NIXL side-channel port
plus ``common.netutil.DIGEST_PORT_OFFSET`` (500) plus the data-parallel rank times the TP size.
"""

from __future__ import annotations

import base64
import json
import logging
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
import zmq

from vllm_hybrid_nixl.protocol.reply_loop import serve_replies

logger = logging.getLogger("vllm.hybrid_nixl.digest")

MAX_REQUEST_BYTES = 4096
MAX_ID_CHARS = 256
#: Bounds of a split question: groups asked, the TP ratio, the regions a page holds.
MAX_SPLIT_GROUPS = 64
MAX_SPLIT_RATIO = 1024
MAX_SPLIT_REGIONS = 4096

#: A decode rank's part of the prefill's pages, per group: (ratio, part, regions a page).
Split = dict[int, tuple[int, int, int]]
#: Largest reply a decode worker reads (a 1M-token prompt at block 16 is ~2 MB per group).
MAX_REPLY_BYTES = 64 * 1024 * 1024


class DigestAskFailed(ConnectionError):
    """The digest question got no usable answer (the message says why)."""


def part_of_cells(cells: np.ndarray, ratio: int, part: int) -> np.ndarray:
    """``[n, 2]`` lanes of part ``part`` of ``ratio`` of every region, from ``[n, regions,
    cells, 2]`` cell lanes (raises ValueError when ``ratio`` does not divide the cells)."""
    count = cells.shape[2]
    if ratio < 1 or count % ratio or not 0 <= part < ratio:
        raise ValueError(f"part {part} of {ratio} does not fall on {count} cells a region")
    width = count // ratio
    chosen = cells[:, :, part * width : (part + 1) * width, :]
    with np.errstate(over="ignore"):
        return chosen.sum(axis=(1, 2), dtype=np.uint64)


@dataclass(frozen=True)
class GroupDigests:
    """Kernel page ids of one KV-cache group and their two digest lanes each."""

    pages: np.ndarray  # int64 [n]
    lanes: np.ndarray  # uint64 [n, 2]
    cells: np.ndarray | None = None  # uint64 [n, regions, cells, 2]: kept, never sent
    unverifiable: str = ""  # a split the prefill could not answer: why (no pages then)

    def part(self, ratio: int, part: int, regions: int) -> GroupDigests:
        """These pages' lanes of part ``part`` of ``ratio`` of every region (raises
        ValueError, saying why, when the kept cells cannot give it)."""
        cells = self.cells
        if cells is None:
            raise ValueError("its pages were digested whole (no cell plan on this rank)")
        if cells.shape[1] != regions:
            raise ValueError(f"its pages hold {cells.shape[1]} regions, the asker {regions}")
        return GroupDigests(self.pages, part_of_cells(cells, ratio, part))

    def of(self) -> dict[int, tuple[int, int]]:
        return {int(p): (int(a), int(b)) for p, (a, b) in zip(self.pages, self.lanes, strict=True)}

    def to_wire(self) -> dict[str, str]:
        return {
            "pages": base64.b64encode(self.pages.astype("<i8").tobytes()).decode(),
            "lanes": base64.b64encode(self.lanes.astype("<u8").tobytes()).decode(),
        }

    @classmethod
    def from_wire(cls, value: object) -> GroupDigests:
        if not isinstance(value, dict):
            raise ValueError("a group's digests must be an object")
        pages_text, lanes_text = value.get("pages"), value.get("lanes")
        if not isinstance(pages_text, str) or not isinstance(lanes_text, str):
            raise ValueError("pages and lanes must be base64 strings")
        pages = np.frombuffer(base64.b64decode(pages_text, validate=True), dtype="<i8")
        lanes = np.frombuffer(base64.b64decode(lanes_text, validate=True), dtype="<u8")
        if lanes.size != 2 * pages.size:
            raise ValueError(f"{pages.size} pages but {lanes.size} lane values")
        return cls(pages.astype(np.int64), lanes.reshape(-1, 2).astype(np.uint64))


#: What a prefill worker knows of a request: None (unknown), "pending", or its digests.
Lookup = Callable[[str], "dict[int, GroupDigests] | str | None"]


def _error(message: str) -> dict[str, object]:
    return {"error": message}


def parse_split(value: object) -> Split:
    """A question's ``split`` (raises ValueError, saying what is wrong)."""
    if not isinstance(value, dict) or len(value) > MAX_SPLIT_GROUPS:
        raise ValueError(f"split must be an object of at most {MAX_SPLIT_GROUPS} groups")
    split: Split = {}
    for key, item in value.items():
        if (
            not isinstance(key, str)
            or not key.isdigit()
            or not isinstance(item, list)
            or len(item) != 3
            or not all(isinstance(v, int) and not isinstance(v, bool) for v in item)
        ):
            raise ValueError("split maps a group number to [ratio, part, regions]")
        ratio, part, regions = item
        if not (
            1 <= ratio <= MAX_SPLIT_RATIO
            and 0 <= part < ratio
            and 1 <= regions <= MAX_SPLIT_REGIONS
        ):
            raise ValueError(
                f"split [{ratio}, {part}, {regions}] is out of range (ratio 1..{MAX_SPLIT_RATIO},"
                f" part 0..ratio-1, regions 1..{MAX_SPLIT_REGIONS})"
            )
        split[int(key)] = (ratio, part, regions)
    return split


def answer(raw: bytes, lookup: Lookup) -> dict[str, object]:
    """The reply to one message (an ``error`` reply for anything malformed)."""
    try:
        request = json.loads(raw)
    except (ValueError, RecursionError) as exc:
        return _error(f"not a JSON digest request ({type(exc).__name__})")
    if not isinstance(request, dict) or request.get("op") != "digest":
        return _error('a digest request is an object with "op": "digest"')
    req = request.get("req")
    if not isinstance(req, str) or not 0 < len(req) <= MAX_ID_CHARS:
        return _error(f"req must be a request id (a string of 1..{MAX_ID_CHARS} characters)")
    try:
        split = parse_split(request["split"]) if "split" in request else {}
    except ValueError as exc:
        return {"req": req, "error": str(exc)}
    try:
        found = lookup(req)
    except Exception as exc:  # noqa: BLE001 - the asker learns why, by its request id
        return {"req": req, "error": f"the digest service failed on it: {exc!r:.200}"}
    if found is None:
        return {"req": req, "state": "unknown"}
    if isinstance(found, str):
        return {"req": req, "state": "pending"}
    groups: dict[str, object] = {}
    unsplit: dict[str, str] = {}
    parts: dict[str, list[int]] = {}
    for group, digests in found.items():
        if group not in split:
            groups[str(group)] = digests.to_wire()
            continue
        try:
            groups[str(group)] = digests.part(*split[group]).to_wire()
            parts[str(group)] = list(split[group])
        except ValueError as exc:
            unsplit[str(group)] = str(exc)
    reply: dict[str, object] = {"req": req, "state": "ready", "groups": groups}
    if parts:
        reply["split"] = parts  # which groups are parts (a release without splits omits it)
    if unsplit:
        reply["unsplit"] = unsplit
    return reply


class DigestServer:
    """A daemon thread answering digest questions from ``lookup`` on ``host:port``."""

    def __init__(self, lookup: Lookup, host: str, port: int) -> None:
        self._lookup = lookup
        self._socket = zmq.Context.instance().socket(zmq.REP)
        self._socket.setsockopt(zmq.LINGER, 0)
        self._socket.setsockopt(zmq.MAXMSGSIZE, MAX_REQUEST_BYTES)
        self._socket.setsockopt(zmq.SNDHWM, 64)  # replies queued for askers that never read
        bind_host = f"[{host}]" if ":" in host else host
        try:
            self._socket.bind(f"tcp://{bind_host}:{port}")
        except zmq.ZMQError:
            self._socket.close()
            raise
        self.endpoint = f"tcp://{bind_host}:{port}"
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._serve, name="hybrid-nixl-digest", daemon=True)
        self._thread.start()

    def close(self) -> None:
        """Stop serving and free the port (the serving thread closes its own socket)."""
        self._stop.set()
        self._thread.join(timeout=2.0)

    def _serve(self) -> None:
        try:
            self._serve_until_stopped()
        finally:
            self._socket.close()

    def _serve_until_stopped(self) -> None:
        serve_replies(
            self._socket,
            lambda raw: answer(raw, self._lookup),
            lambda exc: _error(f"the digest service failed on this message: {exc!r:.200}"),
            "digest service",
            self._stop,
        )


def endpoint_of(host: str, port: int) -> str:
    bracketed = f"[{host}]" if ":" in host else host
    return f"tcp://{bracketed}:{port}"


def ask_digests(
    endpoint: str, remote_req: str, timeout_s: float
) -> dict[int, GroupDigests] | str | None:
    """One question on a connection of its own: the digests, ``"pending"``, or None
    (unknown); raises :class:`DigestAskFailed` for no answer or one that is not this
    protocol."""
    socket = zmq.Context.instance().socket(zmq.REQ)
    socket.setsockopt(zmq.LINGER, 0)
    socket.setsockopt(zmq.MAXMSGSIZE, MAX_REPLY_BYTES)
    where = f"the prefill worker's digest service at {endpoint}"
    try:
        socket.connect(endpoint)
        socket.send(json.dumps({"op": "digest", "req": remote_req}).encode())
        if not socket.poll(max(1, int(timeout_s * 1000))):
            raise DigestAskFailed(f"no answer from {where} within {timeout_s:g} s")
        raw = socket.recv()
    except zmq.ZMQError as exc:
        raise DigestAskFailed(f"could not reach {where}: {exc}") from exc
    finally:
        socket.close()
    return read_reply(raw, remote_req, where)


def read_reply(raw: bytes, remote_req: str, where: str) -> dict[int, GroupDigests] | str | None:
    """The digests in a reply (or ``"pending"`` / None); raises :class:`DigestAskFailed`."""
    try:
        reply = json.loads(raw)
    except (ValueError, RecursionError) as exc:
        raise DigestAskFailed(f"{where} answered something that is not JSON") from exc
    return read_parsed(reply, remote_req, where)


def read_parsed(
    reply: object, remote_req: str, where: str, split: Split | None = None
) -> dict[int, GroupDigests] | str | None:
    """As :func:`read_reply`, for a reply already parsed from JSON; a group asked as a part
    (``split``) that the reply does not say it answered as that part is unverifiable (a
    prefill release without split digests answers whole pages)."""
    if not isinstance(reply, dict):
        raise DigestAskFailed(f"{where} answered a {type(reply).__name__}, not an object")
    if "error" in reply:
        raise DigestAskFailed(f"{where} refused the question: {str(reply['error'])[:300]}")
    if reply.get("req") != remote_req:
        raise DigestAskFailed(f"{where} answered for another request")
    state = reply.get("state")
    if state == "unknown":
        return None
    if state == "pending":
        return "pending"
    groups = reply.get("groups")
    if state != "ready" or not isinstance(groups, dict):
        raise DigestAskFailed(f"{where} answered an unusable state {str(state)[:40]!r}")
    unsplit = reply.get("unsplit", {})
    try:
        found = {int(group): GroupDigests.from_wire(value) for group, value in groups.items()}
        if not isinstance(unsplit, dict):
            raise ValueError("unsplit must be an object")
        for group, why in unsplit.items():
            # only a group asked as a part may come back uncut, and not with digests too
            if int(group) not in (split or {}) or int(group) in found:
                raise ValueError(f"group {str(group)[:20]} is unsplit but was not asked so")
            empty = np.zeros(0, dtype=np.int64)
            found[int(group)] = GroupDigests(
                empty, np.zeros((0, 2), dtype=np.uint64), unverifiable=str(why)[:300] or "?"
            )
        answered = reply.get("split", {})
        if not isinstance(answered, dict):
            raise ValueError("split must be an object")
    except (ValueError, TypeError) as exc:
        raise DigestAskFailed(f"{where} answered unusable digests: {exc}") from exc
    for group, asked in (split or {}).items():
        digests = found.get(group)
        if digests is None or digests.unverifiable:
            continue
        if answered.get(str(group)) != list(asked):
            found[group] = GroupDigests(
                np.zeros(0, dtype=np.int64),
                np.zeros((0, 2), dtype=np.uint64),
                unverifiable="its prefill engine answered whole pages, not the part asked "
                "(a vllm-hybrid-nixl release without split digests)",
            )
    return found


@dataclass
class _Question:
    deadline: float
    retry_at: float
    split: Split | None = None
    asks: int = 0
    last: str = "no answer"


class DigestAsker:
    """Non-blocking digest questions for one thread (a decode worker's engine thread): one
    ZeroMQ DEALER per endpoint, questions sent without waiting, answers collected by
    :meth:`poll` (no thread of its own, so nothing waits for the GIL behind a busy engine).
    A question answered ``pending`` or ``unknown``, or unanswered, is asked again every
    :data:`RETRY_S` until its deadline; then it fails with the last reason."""

    RETRY_S = 0.02
    #: An unanswered question is sent again after this long (a lost or restarted service).
    RESEND_S = 2.0
    MAX_ANSWERS = 10_000
    #: An answer not taken this long after it came is dropped (its read failed or went).
    KEEP_ANSWER_S = 120.0
    #: A connection with no question this long is closed (prefill engines come and go).
    IDLE_CLOSE_S = 300.0

    def __init__(self) -> None:
        self._sockets: dict[str, zmq.Socket] = {}
        self._questions: dict[tuple[str, str], _Question] = {}
        self._answers: dict[
            tuple[str, str], tuple[float, dict[int, GroupDigests] | DigestAskFailed]
        ] = {}
        self._used: dict[str, float] = {}

    def ask(
        self, endpoint: str, remote_req: str, deadline: float, split: Split | None = None
    ) -> None:
        """Ask ``endpoint`` for ``remote_req``'s digests (again only if not under way), of
        the ``split`` part of each page where given."""
        key = (endpoint, remote_req)
        running = self._questions.get(key)
        if running is not None:
            running.deadline = max(running.deadline, deadline)
            return
        stored = self._answers.get(key)
        if stored is not None and not isinstance(stored[1], DigestAskFailed):
            return
        self._answers.pop(key, None)  # a failed one is asked again, by the new deadline
        self._questions[key] = _Question(deadline, 0.0, split or None)
        self._send(key, time.monotonic())

    def _close_idle(self, now: float) -> None:
        asked = {endpoint for endpoint, _ in self._questions}
        for endpoint, used in list(self._used.items()):
            if endpoint not in asked and used < now - self.IDLE_CLOSE_S:
                socket = self._sockets.pop(endpoint, None)
                if socket is not None:
                    socket.close()
                del self._used[endpoint]

    def _socket(self, endpoint: str) -> zmq.Socket:
        self._used[endpoint] = time.monotonic()
        socket = self._sockets.get(endpoint)
        if socket is None:
            socket = zmq.Context.instance().socket(zmq.DEALER)
            socket.setsockopt(zmq.LINGER, 0)
            socket.setsockopt(zmq.MAXMSGSIZE, MAX_REPLY_BYTES)
            socket.connect(endpoint)
            self._sockets[endpoint] = socket
        return socket

    def _send(self, key: tuple[str, str], now: float) -> None:
        question = self._questions[key]
        question.asks += 1
        question.retry_at = now + self.RESEND_S
        body: dict[str, object] = {"op": "digest", "req": key[1]}
        if question.split:
            body["split"] = {str(g): list(value) for g, value in question.split.items()}
        message = json.dumps(body).encode()
        try:
            self._socket(key[0]).send_multipart([b"", message], flags=zmq.NOBLOCK)
        except zmq.ZMQError as exc:
            question.last = f"could not send to {key[0]}: {exc}"
            question.retry_at = now + self.RETRY_S

    def answer(self, endpoint: str, remote_req: str) -> dict[int, GroupDigests] | None:
        """The digests once in (None while under way); raises :class:`DigestAskFailed`
        when the question failed. Either way the answer is then forgotten."""
        stored = self._answers.pop((endpoint, remote_req), None)
        found = stored[1] if stored is not None else None
        if isinstance(found, DigestAskFailed):
            raise found
        return found

    def forget(self, endpoint: str, remote_req: str) -> None:
        self._questions.pop((endpoint, remote_req), None)
        self._answers.pop((endpoint, remote_req), None)

    def poll(self) -> None:
        """Collect every reply that arrived, ask again where due, fail what is overdue."""
        for endpoint, socket in self._sockets.items():
            while True:
                try:
                    frames = socket.recv_multipart(flags=zmq.NOBLOCK)
                except zmq.Again:
                    break
                except zmq.ZMQError as exc:
                    logger.warning("vllm-hybrid-nixl: digest reply from %s: %s", endpoint, exc)
                    break
                self._take(endpoint, frames[-1] if frames else b"")
        now = time.monotonic()
        while self._answers and (  # answers nobody came back for
            len(self._answers) > self.MAX_ANSWERS
            or next(iter(self._answers.values()))[0] < now - self.KEEP_ANSWER_S
        ):
            self._answers.pop(next(iter(self._answers)))
        self._close_idle(now)
        for key, question in list(self._questions.items()):
            if now > question.deadline:
                del self._questions[key]
                self._answers[key] = (
                    now,
                    DigestAskFailed(
                        f"{key[0]}: {question.last} by the deadline ({question.asks} question(s))"
                    ),
                )
            elif now >= question.retry_at:
                self._send(key, now)

    def _take(self, endpoint: str, raw: bytes) -> None:
        try:
            reply = json.loads(raw)
        except (ValueError, RecursionError):
            return  # not ours to match; the question is asked again or times out
        req = reply.get("req") if isinstance(reply, dict) else None
        key = (endpoint, req) if isinstance(req, str) else None
        question = self._questions.get(key) if key else None
        if question is None:
            return  # a late answer to a question already settled
        where = f"the prefill worker's digest service at {endpoint}"
        try:
            found = read_parsed(reply, req, where, question.split)
        except DigestAskFailed as exc:
            question.last = str(exc)
            question.retry_at = time.monotonic() + self.RETRY_S
            return
        if found is None or isinstance(found, str):
            question.last = f"no digests of prefill request {req} (unknown or pending)"
            question.retry_at = time.monotonic() + self.RETRY_S
            return
        del self._questions[key]
        self._answers[key] = (time.monotonic(), found)

    def close(self) -> None:
        for socket in self._sockets.values():
            socket.close()
        self._sockets.clear()
        self._used.clear()

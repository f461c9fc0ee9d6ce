"""The two legs of a disaggregated request, with engine choice, retries and health records.

Prefill leg (``max_tokens=1``, not streamed, ``do_remote_decode``): any failure of the engine
(unreachable, timeout, 5xx) is retried on another prefill engine, up to
``prefill_attempts`` engines. Decode leg (the client's request plus the prefill's
``kv_transfer_params``): retried on another decode engine only when the request never reached
the engine (connection refused), because a decode engine that got it may already have read,
and released, the prefill's blocks. A decode engine's 5xx before any byte went to the client
(e.g. a failed KV load under vLLM's ``kv_load_failure_policy: fail``), or a decode
connection that broke before any answer, re-runs the whole request once (``request_retries``:
a fresh prefill, so no block is read twice), on other engines when there are any. Client
errors (4xx) pass through untouched.
"""

from __future__ import annotations

import asyncio
import json
import logging
import secrets
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import httpx

from vllm_hybrid_nixl.protocol.draining import DRAINING_TYPE
from vllm_hybrid_nixl.protocol.lease_table import READ, LeaseState
from vllm_hybrid_nixl.protocol.lease_wire import PARAMS_KEY, LeaseAddress, LeaseAskFailed, ask
from vllm_hybrid_nixl.router.backends import Backend, BackendPool, NoCompatiblePairError
from vllm_hybrid_nixl.router.health import HealthTracker
from vllm_hybrid_nixl.router.leg_http import LegClient, LegResponse, LegTransportError
from vllm_hybrid_nixl.router.metrics import RouterMetrics
from vllm_hybrid_nixl.router.pairing import PairingTable
from vllm_hybrid_nixl.router.policy import AFFINITY_SLACK, choose, prefix_key, prompt_tokens
from vllm_hybrid_nixl.router.prefix_memory import PrefixMemory, PromptChunks, prompt_chunks
from vllm_hybrid_nixl.router.settings import RouterSettings

logger = logging.getLogger("vllm_hybrid_nixl.router")


class LegError(Exception):
    """A leg that did not produce a usable answer.

    ``kind``: unreachable | timeout | engine_error (5xx) | client_error (4xx) | protocol;
    ``delivered``: whether the engine may have received the request."""

    def __init__(
        self,
        leg: str,
        backend: Backend,
        status: int,
        detail: str,
        kind: str,
        delivered: bool = True,
        upstream: dict[str, Any] | None = None,
    ) -> None:
        super().__init__(detail)
        self.leg, self.backend, self.status, self.detail = leg, backend, status, detail
        self.kind, self.delivered = kind, delivered
        self.upstream = upstream or {}  # the engine's own error object, when it sent one

    @property
    def engine_fault(self) -> bool:
        return self.kind in ("unreachable", "timeout", "engine_error")

    @property
    def message(self) -> str:
        """For logs and operators: names the engine's address."""
        return (
            f"{self.leg} leg failed on engine {self.backend.label} ({self.backend.url}): "
            f"{self.detail}"
        )

    @property
    def public_message(self) -> str:
        """For clients: the engine's own message for a request it judged, else what failed,
        by engine name; never an address."""
        if self.kind == "client_error" and self.upstream.get("message"):
            return str(self.upstream["message"])
        return f"{self.leg} leg failed on engine {self.backend.label}: {self.detail}"


class NoEngineError(LookupError):
    """No engine of a role could take the leg; names every engine tried and why."""

    def __init__(self, leg: str, tried: list[LegError], unavailable: list[Backend]) -> None:
        def text(with_addresses: bool) -> str:
            where = (lambda b: f"{b.label} ({b.url})") if with_addresses else (lambda b: b.label)
            parts = [f"{where(e.backend)}: {e.detail}" for e in tried]
            parts += [f"{where(b)}: not healthy" for b in unavailable]
            return f"no {leg} engine could take the request; " + (
                "; ".join(parts) if parts else f"no {leg} engine is configured"
            )

        super().__init__(text(True))
        self.public_message = text(False)
        self.leg = leg


def upstream_error(response: LegResponse) -> dict[str, Any]:
    """The engine's OpenAI-style error object (message, type, param), or {}."""
    try:
        payload = response.json()
    except (json.JSONDecodeError, ValueError):
        return {}
    error = payload.get("error") if isinstance(payload, dict) else None
    if isinstance(error, dict):
        return {k: error[k] for k in ("message", "type", "param") if k in error}
    if isinstance(payload, dict) and isinstance(payload.get("message"), str):
        return {"message": payload["message"], "type": payload.get("type")}
    return {}


def upstream_detail(response: LegResponse) -> str:
    message = upstream_error(response).get("message")
    if message is None:
        try:
            payload = response.json()
            message = payload.get("detail", payload) if isinstance(payload, dict) else payload
        except (json.JSONDecodeError, ValueError):
            message = response.text
    return f"HTTP {response.status}: {str(message)[:500]}"


def client_status(upstream_status: int) -> int:
    """Client errors pass through (the request is at fault); engine errors become 502."""
    return upstream_status if 400 <= upstream_status < 500 else 502


def prefill_body(body: dict[str, Any]) -> dict[str, Any]:
    leg = {k: v for k, v in body.items() if k not in ("stream_options", "max_completion_tokens")}
    leg.update(max_tokens=1, stream=False, kv_transfer_params={"do_remote_decode": True})
    if "n" in leg:
        leg["n"] = 1
    # vLLM refuses min_tokens above max_tokens; the decode leg keeps the client's value.
    minimum = leg.get("min_tokens")
    if isinstance(minimum, int) and not isinstance(minimum, bool) and minimum > 1:
        leg["min_tokens"] = 1
    return leg


@dataclass
class DecodeAnswer:
    prefill: Backend
    decode: Backend
    response: LegResponse  # 200; a stream still open when the client asked for one
    first: bytes = b""  # streams: the first event, already read (nothing sent to the client)


def role_only(event: bytes) -> bool:
    """Whether ``event`` is a chat stream's opening chunk: a role and no text yet (vLLM sends
    it before the prompt's KV is loaded, so a failed load follows it)."""
    text = event.strip()
    if not text.startswith(b"data: {"):
        return False
    try:
        payload = json.loads(text[6:])
    except ValueError:
        return False
    choices = payload.get("choices") if isinstance(payload, dict) else None
    if not isinstance(choices, list) or not choices:
        return False
    for choice in choices:
        delta = choice.get("delta") if isinstance(choice, dict) else None
        if not isinstance(delta, dict) or "role" not in delta or choice.get("finish_reason"):
            return False
        if delta.get("content") or delta.get("tool_calls") or delta.get("reasoning_content"):
            return False
    return True


async def first_event(response: LegResponse) -> bytes:
    """Read a stream up to the end of its first server-sent event that says how the request
    went (chat's role-only opening chunks are read past), or to its end."""
    buffered = b""
    while True:
        while b"\n\n" not in buffered:
            chunk = await response.next_chunk()
            if not chunk:
                return buffered
            buffered += chunk
        *events, _ = buffered.split(b"\n\n")
        if not all(role_only(e) for e in events if e.strip()):
            return buffered
        more = await response.next_chunk()
        if not more:
            return buffered
        buffered += more


def stream_error(events: bytes) -> str | None:
    """The message of the first error event among ``events`` (vLLM streams errors after a
    200, and in chat after the role chunk), else None."""
    for event in events.split(b"\n\n"):
        text = event.strip()
        if not text.startswith(b"data: {"):
            continue
        try:
            payload = json.loads(text[6:])
        except ValueError:
            continue
        error = payload.get("error") if isinstance(payload, dict) else None
        if error is not None:
            return str(error.get("message", error) if isinstance(error, dict) else error)
    return None


def leg_request_id() -> str:
    """One id for both legs of one attempt: vLLM's push mode pairs a decode leg with its
    prefill by it (its base, vLLM's random suffix stripped), and a re-run gets a new one so
    it can never be paired with the failed attempt's prefill."""
    return f"vhn-{secrets.token_hex(16)}"


async def lease_was_released(params: dict[str, Any]) -> str:
    """Why the prefill's blocks were no longer readable, asked of the prefill engine's lease
    service after a failed decode leg; empty when they were (or it cannot tell)."""
    address = LeaseAddress.from_params(params.get(PARAMS_KEY))
    remote = params.get("remote_request_id")
    if address is None or remote is None:
        return ""
    try:
        answers = await asyncio.to_thread(ask, address, "status", [str(remote)], 2.0)
    except LeaseAskFailed:
        return ""
    status = answers[str(remote)]
    if status.state is LeaseState.RELEASED and status.reason != READ:
        return status.reason
    if status.state is LeaseState.UNKNOWN and status.reason:
        return status.reason  # the prefill engine restarted
    return ""


class Disaggregator:
    """Runs requests over ``pool``; ``client`` (probes, model lists) and ``legs`` are set
    by the app's lifespan."""

    def __init__(
        self,
        pool: BackendPool,
        pairing: PairingTable,
        health: HealthTracker,
        metrics: RouterMetrics,
        settings: RouterSettings,
        prefix_memory: PrefixMemory | None = None,
    ) -> None:
        self.pool, self.pairing, self.health = pool, pairing, health
        self.metrics, self.settings = metrics, settings
        self.prefix_memory = prefix_memory
        self.client: httpx.AsyncClient | None = None
        self.legs: LegClient | None = None

    # ---- one leg -------------------------------------------------------------------

    async def send_leg(
        self, leg: str, backend: Backend, path: str, body: dict[str, Any], stream: bool
    ) -> LegResponse:
        assert self.legs is not None, "the router's lifespan opens the leg client"
        settings = self.settings
        if leg == "prefill":
            timeout = self.legs.timeout(settings.prefill_timeout_s, settings.prefill_timeout_s)
        else:
            timeout = self.legs.timeout(settings.decode_read_timeout_s)
        started = time.perf_counter()
        self.leg_started(backend)
        try:
            response = await self.legs.post(f"{backend.url}{path}", body, stream, timeout)
        except LegTransportError as exc:
            status = 504 if exc.kind == "timeout" else 502
            failure = LegError(leg, backend, status, exc.detail, exc.kind, exc.delivered)
            raise self._failed(failure) from exc
        except BaseException:
            self.leg_ended(backend)
            raise
        self.metrics.child(self.metrics.leg_seconds, leg).observe(time.perf_counter() - started)
        if response.status == 503 and upstream_error(response).get("type") == DRAINING_TYPE:
            raise self._draining(leg, backend, response)
        if response.status != 200:
            kind = "client_error" if 400 <= response.status < 500 else "engine_error"
            error = LegError(
                leg,
                backend,
                client_status(response.status),
                upstream_detail(response),
                kind,
                upstream=upstream_error(response),
            )
            if kind == "client_error":  # the engine is fine; the request was at fault
                self.health.record_success(backend)
                self.leg_ended(backend)
                self.metrics.child(
                    self.metrics.leg_requests, leg, backend.url, "client_error"
                ).inc()
                raise error
            raise self._failed(error)
        self.metrics.child(self.metrics.leg_requests, leg, backend.url, "ok").inc()
        self.health.record_success(backend)
        if not stream:
            self.leg_ended(backend)
        return response

    def _draining(self, leg: str, backend: Backend, response: LegResponse) -> LegError:
        """The engine is shutting down and refused the leg before running it: out of
        rotation until a probe finds it serving again; the leg was not delivered."""
        self.leg_ended(backend)
        self.metrics.child(self.metrics.leg_requests, leg, backend.url, "draining").inc()
        self.health.mark_draining(backend)
        logger.info("engine %s (%s) is draining; it leaves rotation", backend.label, backend.url)
        return LegError(
            leg, backend, 503, upstream_detail(response), "engine_error", delivered=False
        )

    def _failed(self, error: LegError) -> LegError:
        self.leg_ended(error.backend)
        self.metrics.child(
            self.metrics.leg_requests, error.leg, error.backend.url, error.kind
        ).inc()
        self.health.record_failure(error.backend, error.detail)
        logger.warning("%s", error.message)
        return error

    def leg_started(self, backend: Backend) -> None:
        self.health.leg_started(backend)
        self.metrics.child(self.metrics.engine_in_flight, backend.url).inc()

    def leg_ended(self, backend: Backend) -> None:
        self.health.leg_ended(backend)
        self.metrics.child(self.metrics.engine_in_flight, backend.url).dec()

    # ---- engine choice ---------------------------------------------------------------

    def _pick(
        self,
        role: str,
        usable: Callable[[Backend], bool],
        exclude: list[Backend],
        avoid: Sequence[Backend],
        key: bytes | None = None,
        count: bool = True,
    ) -> Backend | None:
        """A usable engine of ``role`` not in ``exclude`` chosen by the role's policy, one
        not in ``avoid`` (the engines a re-run moves away from) when there is one; counted
        in ``router_policy_choices_total`` unless the caller counts it otherwise."""
        policy = self.settings.prefill_policy if role == "prefill" else self.settings.decode_policy

        def by_policy(candidates: list[Backend]) -> Backend:
            backend, reason = choose(candidates, policy, self.health.in_flight, key)
            if count:
                self.metrics.child(self.metrics.policy_choices, role, reason, backend.url).inc()
            return backend

        return self.pool.pick(role, usable, [*exclude, *avoid], by_policy) or self.pool.pick(
            role, usable, exclude, by_policy
        )

    def _pairable(self, prefill: Backend) -> bool:
        return any(not self.pairing.problem(prefill, d) for d in self.pool.decode)

    def _refuse_if_nothing_pairs(self) -> None:
        if (
            self.pool.prefill
            and self.pool.decode
            and not any(self._pairable(p) for p in self.pool.prefill)
        ):
            raise NoCompatiblePairError(self.pairing.problems(self.pool.prefill, self.pool.decode))

    # ---- the request ------------------------------------------------------------------

    async def prefill(
        self, path: str, body: dict[str, Any], avoid: list[Backend]
    ) -> tuple[Backend, dict[str, Any]]:
        """Run the prefill leg; returns the engine and its ``kv_transfer_params``."""
        self._refuse_if_nothing_pairs()
        tried: list[LegError] = []
        affinity = self.settings.prefill_policy == "prefix_affinity"
        affinity_key = prefix_key(body) if affinity else None

        def usable(p: Backend) -> bool:
            return self._pairable(p) and self.health.usable(p)

        for _ in range(self.settings.prefill_attempts):
            exclude = [e.backend for e in tried]
            prefill = self._pick("prefill", usable, exclude, avoid, affinity_key)
            if prefill is None:
                break
            try:
                response = await self.send_leg("prefill", prefill, path, prefill_body(body), False)
            except LegError as exc:
                if not exc.engine_fault:
                    raise
                tried.append(exc)
                self.metrics.child(self.metrics.retries, "prefill").inc()
                continue
            try:
                answer = response.json()
            except ValueError:
                answer = None
            params = answer.get("kv_transfer_params") if isinstance(answer, dict) else None
            if not isinstance(params, dict) or not params:
                raise LegError(
                    "prefill",
                    prefill,
                    502,
                    "the engine returned no kv_transfer_params; is it running with "
                    "--kv-transfer-config and kv_role kv_producer?",
                    "protocol",
                )
            return prefill, params
        unavailable = [p for p in self.pool.prefill if p not in [e.backend for e in tried]]
        raise NoEngineError("prefill", tried, unavailable)

    async def decode(
        self,
        prefill: Backend,
        path: str,
        body: dict[str, Any],
        stream: bool,
        avoid: Sequence[Backend] = (),
    ) -> DecodeAnswer:
        tried: list[LegError] = []

        def usable(d: Backend) -> bool:
            return not self.pairing.problem(prefill, d) and self.health.usable(d)

        while True:
            exclude = [e.backend for e in tried]
            decode = self._pick("decode", usable, exclude, avoid)
            if decode is None:
                unavailable = [d for d in self.pool.decode if d not in [e.backend for e in tried]]
                raise NoEngineError("decode", tried, unavailable)
            try:
                response = await self.send_leg("decode", decode, path, body, stream)
            except LegError as exc:
                if exc.delivered or len(tried) + 1 >= self.settings.decode_attempts:
                    raise
                tried.append(exc)  # never reached the engine: the blocks are still there
                self.metrics.child(self.metrics.retries, "decode").inc()
                continue
            if not stream:
                return DecodeAnswer(prefill, decode, response)
            return await self._checked_stream(prefill, decode, response)

    async def _checked_stream(
        self, prefill: Backend, decode: Backend, response: LegResponse
    ) -> DecodeAnswer:
        """vLLM answers a stream with 200 before it has loaded the prompt's KV; a failed
        load then arrives as the first event. Read that event before the client gets a
        byte, so such a failure can still re-run the whole request."""
        try:
            first = await first_event(response)
        except LegTransportError as exc:
            response.close()
            raise self._failed(
                LegError("decode", decode, 502, f"stream broke: {exc.detail}", "unreachable")
            ) from exc
        except BaseException:
            response.close()
            self.leg_ended(decode)
            raise
        message = stream_error(first)
        if message is not None:
            response.close()
            raise self._failed(
                LegError(
                    "decode", decode, 502, f"first event was an error: {message}", "engine_error"
                )
            )
        return DecodeAnswer(prefill, decode, response, first)

    async def colocated_instead(
        self, missing: NoEngineError, path: str, body: dict[str, Any], stream: bool
    ) -> DecodeAnswer:
        """No engine could take one leg (none up, e.g. during a rolling restart, or every
        one failed): with ``colocated_fallback`` the whole request runs on one engine that
        is up, a decode engine first, as an ordinary request (no KV moves). Without it, or
        with no engine up, ``missing`` is raised."""
        if not self.settings.colocated_fallback:
            raise missing
        reason = f"no_{missing.leg}"
        for role in ("decode", "prefill"):
            engine = self._pick(role, self.health.usable, [], [], count=False)
            if engine is None:
                continue
            self.metrics.child(self.metrics.policy_choices, "colocated", reason, engine.url).inc()
            logger.info(
                "no %s engine could take the request; running it colocated on %s",
                missing.leg,
                engine.label,
            )
            return await self._colocated_leg(engine, path, body, stream)
        raise missing

    async def _colocated_leg(
        self, engine: Backend, path: str, body: dict[str, Any], stream: bool
    ) -> DecodeAnswer:
        """The whole request on ``engine`` as an ordinary request (no KV moves); a stream's
        first event is checked before the client gets a byte."""
        response = await self.send_leg("colocated", engine, path, body, stream)
        if not stream:
            return DecodeAnswer(engine, engine, response)
        return await self._checked_stream(engine, engine, response)

    def colocated_engine(
        self, body: dict[str, Any], chat: bool, chunks: PromptChunks | None
    ) -> tuple[Backend | None, str]:
        """The decode engine to run a request whole on, and why, with conditional
        disaggregation on (``short_prompt_tokens``): ``cached_prefix`` when a decode engine
        is thought to hold all of the prompt's start but fewer than the threshold's tokens
        (and is not ``AFFINITY_SLACK`` legs busier than the least busy one), else
        ``short_prompt`` for a prompt below the threshold; (None, "") sends it P/D, as for a
        prompt whose length cannot be told."""
        threshold = self.settings.short_prompt_tokens
        tokens = prompt_tokens(body, chat) if threshold else None
        if tokens is None:
            return None, ""
        if self.prefix_memory is not None and chunks is not None and chunks.keys:
            usable = [d for d in self.pool.decode if self.health.usable(d)]
            url, cached = self.prefix_memory.best_engine([d.url for d in usable], chunks)
            holder = next((d for d in usable if d.url == url), None)
            uncached = tokens * (1.0 - chunks.cached_share(cached))
            if holder is not None and uncached < threshold:
                least = min(self.health.in_flight(d) for d in usable)
                if self.health.in_flight(holder) - least < AFFINITY_SLACK:
                    return holder, "cached_prefix"
        if tokens < threshold:
            return self._pick("decode", self.health.usable, [], [], count=False), "short_prompt"
        return None, ""

    async def colocated_on_decode(
        self, path: str, body: dict[str, Any], stream: bool, chunks: PromptChunks | None
    ) -> tuple[DecodeAnswer | None, list[Backend]]:
        """A short prompt, or one whose start a decode engine already holds, runs whole on
        a decode engine (a prefill hop and a KV transfer cost more than what is left to
        prefill), counted as ``router_policy_choices_total{role="colocated",reason=...}``.
        No answer (the request goes P/D) when :meth:`colocated_engine` finds none or the
        engine failed before the client got a byte; then also the engine to avoid."""
        engine, reason = self.colocated_engine(body, path.endswith("/chat/completions"), chunks)
        if engine is None:
            return None, []
        self.metrics.child(self.metrics.policy_choices, "colocated", reason, engine.url).inc()
        leg_body = {**body, "request_id": leg_request_id()}
        try:
            return await self._colocated_leg(engine, path, leg_body, stream), []
        except LegError as exc:
            if exc.kind == "client_error":  # the request is at fault: P/D would fail alike
                raise
            logger.warning("%s; running the request P/D instead", exc.message)
            return None, [exc.backend]

    async def run(self, path: str, body: dict[str, Any]) -> DecodeAnswer:
        """Both legs; a decode engine's 5xx re-runs the whole request (bounded). A short
        prompt, or one mostly cached on a decode engine, runs colocated on a decode engine
        instead (``short_prompt_tokens``). The prompt is remembered as held by the decode
        engine that answered (for later ``cached_prefix`` choices)."""
        memory = self.prefix_memory  # only with short_prompt_tokens set (build_app)
        chunks = None
        if memory is not None:
            chunks = prompt_chunks(body, chat=path.endswith("/chat/completions"))
        answer = await self._run(path, body, chunks)
        if memory is not None and chunks is not None:
            memory.remember(answer.decode.url, chunks)
        return answer

    async def _run(
        self, path: str, body: dict[str, Any], chunks: PromptChunks | None
    ) -> DecodeAnswer:
        stream = bool(body.get("stream"))
        colocated, avoid_decode = await self.colocated_on_decode(path, body, stream, chunks)
        if colocated is not None:
            return colocated
        avoid: list[Backend] = []
        for attempt in range(self.settings.request_retries + 1):
            legs_body = {**body, "request_id": leg_request_id()}
            try:
                prefill, params = await self.prefill(path, legs_body, avoid)
            except NoEngineError as exc:
                return await self.colocated_instead(exc, path, legs_body, stream)
            try:
                return await self.decode(
                    prefill, path, {**legs_body, "kv_transfer_params": params}, stream, avoid_decode
                )
            except NoEngineError as exc:
                return await self.colocated_instead(exc, path, legs_body, stream)
            except LegError as exc:
                rerun = exc.kind in ("engine_error", "unreachable")
                if not rerun or attempt == self.settings.request_retries:
                    raise
                released = await lease_was_released(params)
                logger.warning(
                    "%s; running the whole request again%s",
                    exc.message,
                    f" (the prefill's KV lease: {released})" if released else "",
                )
                self.metrics.child(self.metrics.retries, "request").inc()
                if released:
                    self.metrics.lease_reruns.inc()
                    # The decode engine answered as it should: the prefill released the
                    # blocks. Its breaker must not count that against it.
                    self.health.record_success(exc.backend)
                avoid = [prefill]
                avoid_decode = [exc.backend]
        raise AssertionError("unreachable")  # the loop returns or raises

"""OpenAI-compatible HTTP API of the coordinator (shell: Starlette ASGI app).

Rules:
- Every error is JSON ``{"error": {"message", "type", "param", "code"}}`` with a stable ``code``;
  bad input never takes the server down.
- A client that disconnects (streamed or not) has its request cancelled, which frees its slot
  before the engine plans its next step.
- Past the bounded queue: 503 with ``Retry-After``.
- Admission (``coordinator.core.admission``, flags ``--tps-floor``, ``--admission``, ``--on-saturation``):
  a new request is decided before it is submitted; held while the core says HOLD (woken by every token
  and every ending); rejected with 429, ``Retry-After`` and code ``over_capacity``; admitted past
  saturation under ``warn`` with ``X-Sessions-Remaining: 0``. ``X-Session-Id`` (at most 256 characters)
  names a session whose later requests are continuations; a body's ``"overcommit": true`` bypasses.
  ``GET /capacity`` says what the next request would meet (DESIGN §11).
- Every body is a ``coordinator.api.schemas`` Struct (errors: ``swarm.protocol.http``'s), encoded by
  this module's one encoder.
- Model names: one model is hosted, so any ``model`` a request gives (or none) means it, as with
  llama-server; with ``strict_model`` only its id, the GGUF file's base name and the ``--alias`` names
  are accepted (else 404 ``model_not_found``). Answers always carry the model id.
"""

from __future__ import annotations

import functools
import math
import secrets
import time
from collections.abc import AsyncIterator, Callable, Iterable
from typing import Any

import msgspec
import trio
from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector
from starlette.applications import Starlette
from starlette.exceptions import HTTPException
from starlette.requests import Request
from starlette.responses import Response, StreamingResponse
from starlette.routing import BaseRoute, Route

from coordinator.api.page import page_routes
from coordinator.api.prefixes import prefix_routes
from coordinator.api.schemas import (
    AssistantMessage,
    ChatChoice,
    ChatChunkChoice,
    ChatCompletion,
    ChatCompletionChunk,
    ChatDelta,
    ChatMessage,
    ChatRequest,
    ChoiceFinishReason,
    Completion,
    CompletionChoice,
    CompletionChunk,
    CompletionChunkChoice,
    CompletionRequest,
    ModelCard,
    ModelList,
    PromptTokensDetails,
    Usage,
    decode_chat,
    decode_completion,
    gen_params,
)
from coordinator.core.scheduler import Emit, Finish, FinishReason, GenParams
from coordinator.engine.runtime import EngineFailed, EngineRuntime, OverCapacity, RequestHandle
from swarm.errors import RequestError, SwarmError
from swarm.http_io import close_if_unread, read_body
from swarm.protocol.coordinator import CapacityReport, Health, MarketLinkStatus, SlotInfo
from swarm.protocol.http import encode_error
from swarm.text.chat import render_chat

__all__ = ["build_app", "error_response"]

MAX_SESSION_ID = 256


def error_response(exc: SwarmError | RequestError, status: int | None = None, headers: dict[str, str] | None = None) -> Response:
    st = status if status is not None else getattr(exc, "status", 400)
    body = encode_error(st, exc.code, exc.message, getattr(exc, "param", None))
    return Response(body, status_code=st, headers=headers, media_type="application/json")


class _EngineCollector(Collector):
    def __init__(self, rt: EngineRuntime, model_id: str) -> None:
        self.rt = rt
        self.model_id = model_id

    def collect(self) -> Iterable[Metric]:
        s = self.rt.stats
        lbl = ["model"]
        v = [self.model_id]

        def counter(name: str, doc: str, value: float) -> Metric:
            c = CounterMetricFamily(name, doc, labels=lbl)
            c.add_metric(v, value)
            return c

        def gauge(name: str, doc: str, value: float) -> Metric:
            g = GaugeMetricFamily(name, doc, labels=lbl)
            g.add_metric(v, value)
            return g

        yield counter("moe_swarm_requests", "Requests accepted", s.requests_total)
        yield counter("moe_swarm_requests_rejected", "Requests rejected (queue full, bad prompt)", s.rejected_total)
        yield counter("moe_swarm_prompt_tokens", "Prompt tokens processed", s.prompt_tokens_total)
        yield counter("moe_swarm_generated_tokens", "Tokens generated", s.generated_tokens_total)
        yield counter("moe_swarm_engine_steps", "Engine steps run", s.steps_total)
        yield gauge("moe_swarm_decode_tokens_per_second", "Aggregate decode tokens/s (EWMA)", s.decode_tps_ewma)
        yield gauge("moe_swarm_prompt_tokens_per_second", "Aggregate prompt tokens/s (EWMA)", s.prompt_tps_ewma)
        yield gauge("moe_swarm_queue_depth", "Requests waiting for a slot", self.rt.queue_depth())
        yield gauge("moe_swarm_busy_slots", "Slots processing a request", self.rt.busy())
        yield gauge("moe_swarm_slots", "Slots", self.rt.n_slots)
        steps = CounterMetricFamily("moe_swarm_draft_steps", "Decode steps that carried drafted tokens, by drafter",
                                    labels=["model", "drafter"])
        toks = CounterMetricFamily("moe_swarm_draft_tokens", "Drafted tokens by drafter and outcome (proposed, "
                                   "accepted; emitted: every token those steps emitted)", labels=["model", "drafter", "outcome"])
        rate = GaugeMetricFamily("moe_swarm_draft_acceptance", "Accepted / proposed drafted tokens, by drafter",
                                 labels=["model", "drafter"])
        per = GaugeMetricFamily("moe_swarm_draft_tokens_per_step", "Tokens emitted per verify step, by drafter",
                                labels=["model", "drafter"])
        for name, d in sorted(self.rt.drafts.items()):
            steps.add_metric([self.model_id, name], d.steps)
            for outcome, n in (("proposed", d.proposed), ("accepted", d.accepted), ("emitted", d.emitted)):
                toks.add_metric([self.model_id, name, outcome], n)
            rate.add_metric([self.model_id, name], d.acceptance or 0.0)
            per.add_metric([self.model_id, name], d.tokens_per_step or 0.0)
        yield steps
        yield toks
        yield rate
        yield per
        yield from self._prefixes()
        yield from self._admission()

    def _admission(self) -> Iterable[Metric]:
        """Experienced speed and admission (``coordinator.core.admission``)."""
        info = self.rt.capacity()
        cap, m = info.capacity, self.model_id
        for name, doc, value in (
                ("mean_active_tps", "Mean decode tokens/s of the running sessions past their settle window (EWMA each)",
                 cap.mean_active_tps),
                ("sessions_decode_tps", "Aggregate decode tokens/s: the sum of the running sessions' EWMAs", cap.decode_tps),
                ("tps_floor", "The mean active tps admission keeps (--tps-floor)", cap.tps_floor),
                ("projected_mean_tps_if_admitted", "The mean active tps projected with one more session",
                 cap.projected_mean_tps_if_admitted)):
            if value is not None:
                yield gauge1(f"moe_swarm_{name}", doc, m, value)
        yield gauge1("moe_swarm_admission_can_admit", "1 while a new request would be admitted now", m, float(cap.can_admit))
        yield gauge1("moe_swarm_admission_headroom_sessions", "More sessions the floor and the free slots allow", m,
                     cap.headroom_sessions)
        yield gauge1("moe_swarm_admission_settling", "1 while a session is in its settle window", m, float(cap.settling))
        yield gauge1("moe_swarm_admission_scaling_per_admit", "The share of one more session's speed the aggregate "
                     "decode tps gained per admit, observed (EWMA; 0: the model before any observation, the "
                     "aggregate shared by one more; 1: every session kept its speed)", m, cap.scaling_per_admit)
        sess = GaugeMetricFamily("moe_swarm_sessions", "Running sessions, by state", labels=["model", "state"])
        sess.add_metric([m, "active"], cap.active_sessions - cap.warming_sessions - cap.parked_sessions)
        sess.add_metric([m, "warming"], cap.warming_sessions)
        sess.add_metric([m, "parked"], cap.parked_sessions)
        yield sess
        core = self.rt.admission
        pk = CounterMetricFamily("moe_swarm_admission_preemptions", "Sessions parked (decode paused while the mean "
                                 "active tps stayed below the floor) and resumed; forced: resumed by --max-park-time",
                                 labels=["model", "event"])
        pk.add_metric([m, "parked"], core.parks_total)
        pk.add_metric([m, "resumed"], core.resumes_total)
        pk.add_metric([m, "forced_resume"], core.forced_resumes_total)
        yield pk
        dec = CounterMetricFamily("moe_swarm_admission_decisions", "Admission decisions on new requests, by verdict "
                                  "and reason (a held request counts as held, then as its outcome)",
                                  labels=["model", "verdict", "reason"])
        for (verdict, reason), n in sorted(self.rt.decisions.items()):
            dec.add_metric([m, verdict, reason], n)
        yield dec

    def _prefixes(self) -> Iterable[Metric]:
        """The kept prefixes (``--prefix-cache-mem``, ``--prefix-cache-dir``): lookups by outcome and
        tier, reused tokens and bytes, evictions, kept bytes and entries, by tier (``ram``, ``disk``)."""
        info = self.rt.prefix_cache()
        if info is None:
            return
        m, st = self.model_id, info.stats
        looks = CounterMetricFamily("moe_swarm_prefix_cache_lookups", "Prompts looked up among the kept prefixes, by "
                                    "outcome (hit: a prefix's KV rows reused, by the tier they came from)",
                                    labels=["model", "outcome", "tier"])
        looks.add_metric([m, "miss", "none"], st.misses)
        counters = {name: CounterMetricFamily(f"moe_swarm_prefix_cache_{name}", doc, labels=["model", "tier"])
                    for name, doc in (("reused_tokens", "Prompt tokens whose KV rows came from a kept prefix"),
                                      ("reused_bytes", "KV bytes copied from kept prefixes into slots"),
                                      ("evictions", "Kept prefixes that left the tier (evicted, spilled to disk, "
                                                    "superseded by a longer one, or a file that failed its checks)"))}
        for tier, ts in st.tiers.items():
            looks.add_metric([m, "hit", tier], ts.hits)
            counters["reused_tokens"].add_metric([m, tier], ts.hit_tokens)
            counters["reused_bytes"].add_metric([m, tier], ts.hit_bytes)
            counters["evictions"].add_metric([m, tier], ts.dropped)
        yield looks
        yield from counters.values()
        yield counter("moe_swarm_prefix_cache_failed_loads", "Kept prefixes whose disk file failed its checks "
                      "(never loaded)", m, st.failed)
        for name, doc, ram, disk in (("bytes", "KV bytes the kept prefixes hold", info.used, info.disk_used),
                                     ("capacity_bytes", "KV bytes the kept prefixes may hold", info.capacity,
                                      info.disk_capacity),
                                     ("entries", "Kept prefixes", info.entries, info.disk_entries)):
            g = GaugeMetricFamily(f"moe_swarm_prefix_cache_{name}", doc, labels=["model", "tier"])
            g.add_metric([m, "ram"], ram)
            g.add_metric([m, "disk"], disk)
            yield g


def gauge1(name: str, doc: str, model: str, value: float) -> Metric:
    g = GaugeMetricFamily(name, doc, labels=["model"])
    g.add_metric([model], value)
    return g


def counter(name: str, doc: str, model: str, value: float) -> Metric:
    c = CounterMetricFamily(name, doc, labels=["model"])
    c.add_metric([model], value)
    return c


_encoder = msgspec.json.Encoder()
DEFAULT_MAX_BODY = 8 << 20  # bytes of one API request body (--max-body)


def _json(body: msgspec.Struct | list[SlotInfo] | dict[str, Any], headers: dict[str, str] | None = None) -> Response:
    return Response(_encoder.encode(body), media_type="application/json", headers=headers)


def _sse(body: ChatCompletionChunk | CompletionChunk) -> bytes:
    return b"data: " + _encoder.encode(body) + b"\n\n"


def build_app(
    rt: EngineRuntime,
    *,
    model_id: str,
    aliases: Iterable[str] = (),
    extra_routes: Iterable[BaseRoute] = (),
    extra_collectors: Iterable[Collector] = (),
    extra_health: Callable[[], tuple[str, MarketLinkStatus | None, int]] | None = None,
    max_body: int = DEFAULT_MAX_BODY,
    strict_model: bool = False,
) -> Starlette:
    """``aliases``: other names of the model a request may give; ``strict_model``: refuse any other name
    (else, with one model hosted, any name is that model, as llama-server does)."""
    names = {model_id, *aliases}
    created = int(time.time())
    registry = CollectorRegistry()
    registry.register(_EngineCollector(rt, model_id))
    for c in extra_collectors:
        registry.register(c)
    tok = rt.tokenizer
    template = rt.model.fields.get("tokenizer.chat_template")
    # a text longer than this has more tokens than the context holds: refused before tokenising
    max_chars = rt.n_ctx * tok.max_token_bytes
    tokenizing = trio.CapacityLimiter(2)  # off the event loop, at most two at a time

    async def encode(text: str, param: str) -> list[int]:
        if len(text) > max_chars:
            raise RequestError(
                f"the prompt has {len(text)} characters: more than the {rt.n_ctx} tokens of the context can hold",
                code="context_length_exceeded", param=param,
            )
        ids: list[int] = await trio.to_thread.run_sync(
            functools.partial(tok.encode, text, parse_special=True), limiter=tokenizing
        )
        return ids

    async def chat_ids(messages: list[ChatMessage], *, generation: bool) -> list[int]:
        """Messages through the chat template (``generation``: with the assistant's opening), tokenised."""
        bos_text = tok.token_text(tok.bos_id) if tok.bos_id is not None else ""
        text = render_chat(
            template if isinstance(template, str) else None,
            [msgspec_to_dict(m) for m in messages],
            add_generation_prompt=generation,
            bos_token=bos_text,
            eos_token=tok.token_text(tok.eos_id) if tok.eos_id is not None else "",
        )
        if tok.add_bos and bos_text and text.startswith(bos_text):
            # the template wrote the bos the tokenizer adds (Mixtral's "<s>[INST]"): once, as
            # llama.cpp's common_chat_templates_apply drops the rendered one
            text = text[len(bos_text):]
        return await encode(text, "messages")

    async def prefix_ids(messages: list[ChatMessage]) -> list[int]:
        return await chat_ids(messages, generation=False)

    def check_model(name: str) -> None:
        if strict_model and name not in names:
            known = ", ".join(repr(n) for n in sorted(names))
            raise RequestError(f"model {name!r} does not exist; this server hosts {model_id!r} (also named: {known})",
                               code="model_not_found", status=404, param="model")

    model_list = ModelList(data=(ModelCard(id=model_id, created=created, owned_by="moe-swarm"),))

    async def models(_: Request) -> Response:
        return _json(model_list)

    async def health(_: Request) -> Response:
        busy = rt.busy()
        peer_id, market, holes = extra_health() if extra_health is not None else (None, None, 0)
        reason = market.problem if market is not None else ""
        return _json(Health(status="degraded" if reason else "ok", reason=reason, model=model_id,
                            slots_idle=rt.n_slots - busy, slots_processing=busy,
                            peer_id=peer_id, market=market, coverage_holes=holes))

    def rnd(x: float | None) -> float | None:
        return None if x is None else round(x, 3)

    async def slots(_: Request) -> Response:
        out = []
        cap = rt.capacity().capacity
        for s in rt.slots():
            draft, acceptance, length = rt.draft_of(s.req_id)
            tps, warming = rt.session_speed(s.req_id)
            out.append(SlotInfo(id=s.id, is_processing=s.is_processing, n_ctx=s.n_ctx, n_prompt=s.n_prompt,
                                n_decoded=s.n_decoded, tps_ewma=round(tps if tps is not None else s.tps_ewma, 3),
                                draft=draft, draft_acceptance=acceptance, draft_length=length, warming=warming,
                                mean_active_tps=rnd(cap.mean_active_tps), decode_tps=rnd(cap.decode_tps),
                                tps_floor=cap.tps_floor, parked=s.parked,
                                projected_mean_tps_if_admitted=rnd(cap.projected_mean_tps_if_admitted)))
        return _json(out)

    async def capacity(_: Request) -> Response:
        info = rt.capacity()
        c = info.capacity
        return _json(CapacityReport(
            can_admit=c.can_admit, projected_mean_tps_if_admitted=rnd(c.projected_mean_tps_if_admitted),
            headroom_sessions=c.headroom_sessions, kv_headroom_pct=info.kv_headroom_pct, settling=c.settling,
            settle_remaining_ms=c.settle_remaining_ms, reason=str(c.reason), mean_active_tps=rnd(c.mean_active_tps),
            tps_floor=c.tps_floor, active_sessions=c.active_sessions, slots=info.slots, queue=info.queue,
            admission=c.admission, decode_tps=rnd(c.decode_tps), warming_sessions=c.warming_sessions,
            scaling_per_admit=round(c.scaling_per_admit, 4), admits_observed=c.admits_observed,
            parked_sessions=c.parked_sessions))

    async def admit(request: Request, req: ChatRequest | CompletionRequest, ids: list[int], params: GenParams,
                    *, prompt_param: str, continuation: bool) -> tuple[RequestHandle, dict[str, str] | None]:
        """Decide (holding while told to), then submit: the handle and the answer's extra headers."""
        sid = request.headers.get("x-session-id") or None
        if sid is not None and len(sid) > MAX_SESSION_ID:
            raise RequestError(f"X-Session-Id has {len(sid)} characters; at most {MAX_SESSION_ID}",
                               code="invalid_session_id")
        handle, d = await rt.admit(ids, params, session_id=sid, overcommit=req.overcommit, prompt_param=prompt_param,
                                   continuation=continuation)
        return handle, ({"X-Sessions-Remaining": "0"} if d.sessions_remaining == 0 else None)

    async def metrics(_: Request) -> Response:
        return Response(generate_latest(registry), media_type="text/plain; version=0.0.4; charset=utf-8")

    async def chat(request: Request) -> Response:
        try:
            req = decode_chat(await read_body(request, max_body))
            check_model(req.model)
            params = gen_params(req, default_max_tokens=rt.n_ctx, max_tokens_override=req.max_completion_tokens)
            ids = await chat_ids(req.messages, generation=True)
            handle, headers = await admit(request, req, ids, params, prompt_param="messages", continuation=False)
        except SwarmError as exc:
            return _err(exc)
        return await _respond(request, req, handle, chat=True, headers=headers)

    async def completions(request: Request) -> Response:
        try:
            req = decode_completion(await read_body(request, max_body))
            check_model(req.model)
            params = gen_params(req, default_max_tokens=16)
            p = req.prompt
            if isinstance(p, str):
                ids = await encode(p, "prompt")
            elif p and isinstance(p[0], str):
                ids = await encode(str(p[0]), "prompt")
            else:
                ids = [int(x) for x in p]
            handle, headers = await admit(request, req, ids, params, prompt_param="prompt", continuation=True)
        except SwarmError as exc:
            return _err(exc)
        return await _respond(request, req, handle, chat=False, headers=headers)

    def _err(exc: SwarmError) -> Response:
        if isinstance(exc, OverCapacity):
            return error_response(exc, headers={"Retry-After": str(max(1, math.ceil(exc.retry_after_s)))})
        if isinstance(exc, RequestError) and exc.status == 503:
            return error_response(exc, headers={"Retry-After": "1"})
        return error_response(exc, headers=close_if_unread(exc))

    async def _respond(request: Request, req: ChatRequest | CompletionRequest, handle: RequestHandle, *, chat: bool,
                       headers: dict[str, str] | None = None) -> Response:
        rid = ("chatcmpl-" if chat else "cmpl-") + secrets.token_hex(12)
        t0 = time.time()
        if req.stream:
            return StreamingResponse(
                _stream(req, handle, rid, int(t0), chat=chat),
                media_type="text/event-stream",
                headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no", **(headers or {})},
            )
        text: list[str] = []
        ids: list[int] = []
        finish: Finish | None = None
        failed: EngineFailed | None = None
        disconnected = False
        async with trio.open_nursery() as nursery:

            async def watch() -> None:
                nonlocal disconnected
                while True:
                    msg = await request.receive()
                    if msg["type"] == "http.disconnect":
                        disconnected = True
                        rt.cancel(handle.req_id)
                        return

            nursery.start_soon(watch)
            try:
                async for ev in handle.events:
                    if isinstance(ev, Emit):
                        text.append(ev.text)
                        ids.extend(ev.token_ids)
                    elif isinstance(ev, Finish):
                        finish = ev
                    else:
                        failed = ev
            finally:
                if finish is None and failed is None:
                    rt.cancel(handle.req_id)
                nursery.cancel_scope.cancel()
        if failed is not None or finish is None:
            msg = failed.message if failed is not None else "request was cancelled"
            if failed is not None:
                return error_response(SwarmError(msg, code=failed.code), status=failed.status)
            return error_response(SwarmError(msg, code="cancelled"), status=500)
        if disconnected:
            return Response(status_code=499)
        content = "".join(text)
        reason = _reason(finish.reason)
        token_ids = tuple(ids) if req.return_token_ids else msgspec.UNSET
        if chat:
            return _json(ChatCompletion(
                id=rid, created=int(t0), model=model_id, usage=_usage(finish),
                choices=(ChatChoice(finish_reason=reason, message=AssistantMessage(content=content), token_ids=token_ids),),
            ), headers)
        return _json(Completion(
            id=rid, created=int(t0), model=model_id, usage=_usage(finish),
            choices=(CompletionChoice(finish_reason=reason, text=content, token_ids=token_ids),),
        ), headers)

    async def _stream(req: ChatRequest | CompletionRequest, handle: RequestHandle, rid: str, created: int, *, chat: bool) -> AsyncIterator[bytes]:
        def chunk(
            delta_text: str | None, ids: tuple[int, ...] | None, reason: ChoiceFinishReason | None, first: bool = False
        ) -> ChatCompletionChunk | CompletionChunk:
            token_ids = ids if ids is not None and req.return_token_ids else msgspec.UNSET
            if chat:
                delta = ChatDelta(role="assistant" if first else None, content=delta_text)
                return ChatCompletionChunk(
                    id=rid, created=created, model=model_id,
                    choices=(ChatChunkChoice(finish_reason=reason, delta=delta, token_ids=token_ids),),
                )
            return CompletionChunk(
                id=rid, created=created, model=model_id,
                choices=(CompletionChunkChoice(finish_reason=reason, text=delta_text or "", token_ids=token_ids),),
            )

        def usage_chunk(f: Finish) -> ChatCompletionChunk | CompletionChunk:
            if chat:
                return ChatCompletionChunk(id=rid, created=created, model=model_id, choices=(), usage=_usage(f))
            return CompletionChunk(id=rid, created=created, model=model_id, choices=(), usage=_usage(f))

        done = False
        try:
            if chat:
                yield _sse(chunk("", (), None, first=True))
            async for ev in handle.events:
                if isinstance(ev, Emit):
                    if ev.text or (req.return_token_ids and ev.token_ids):
                        yield _sse(chunk(ev.text, ev.token_ids, None))
                elif isinstance(ev, Finish):
                    done = True
                    if ev.reason is FinishReason.CANCELLED:
                        return
                    yield _sse(chunk(None if chat else "", None, _reason(ev.reason)))
                    if req.stream_options is not None and req.stream_options.include_usage:
                        yield _sse(usage_chunk(ev))
                    yield b"data: [DONE]\n\n"
                else:
                    done = True
                    yield b"data: " + encode_error(ev.status, ev.code, ev.message) + b"\n\n"
                    return
        finally:
            if not done:
                rt.cancel(handle.req_id)

    async def not_found(request: Request, exc: Exception) -> Response:
        status = getattr(exc, "status_code", 404)
        code = {404: "not_found", 405: "method_not_allowed"}.get(status, "http_error")
        return error_response(RequestError(f"{request.method} {request.url.path}: {getattr(exc, 'detail', 'not found')}", code=code, status=status))

    routes: list[BaseRoute] = [
        Route("/v1/models", models, methods=["GET"]),
        Route("/v1/chat/completions", chat, methods=["POST"]),
        Route("/v1/completions", completions, methods=["POST"]),
        Route("/health", health, methods=["GET"]),
        Route("/slots", slots, methods=["GET"]),
        Route("/capacity", capacity, methods=["GET"]),
        Route("/metrics", metrics, methods=["GET"]),
        *prefix_routes(rt, max_body=max_body, render=prefix_ids, error=_err),
        *page_routes(),  # the chat page at /
        *extra_routes,
    ]
    return Starlette(routes=routes, exception_handlers={HTTPException: not_found})


def _reason(r: FinishReason) -> ChoiceFinishReason:
    return ChoiceFinishReason.LENGTH if r is FinishReason.LENGTH else ChoiceFinishReason.STOP


def _usage(f: Finish) -> Usage:
    return Usage(prompt_tokens=f.n_prompt, completion_tokens=f.n_decoded, total_tokens=f.n_prompt + f.n_decoded,
                 prompt_tokens_details=PromptTokensDetails(cached_tokens=f.n_cached))


def msgspec_to_dict(m: Any) -> dict[str, Any]:
    d: dict[str, Any] = msgspec.to_builtins(m)
    if d.get("content") is None:
        d["content"] = ""
    return d

"""What chat and completion requests share: turning a request into engine jobs (one per choice), waiting
for their events, and the errors they end in.

A request's fields become the arguments of ``SpeculativeGenerator.prepare`` for each of its ``n`` choices
(choice k samples with seed + k); anything the generator refuses is an ``APIError`` (HTTP 400 with the
OpenAI error body) before a job is queued, so a queued job only fails for a fault inside decoding.
"""

from __future__ import annotations

import asyncio
import json
import secrets
from dataclasses import dataclass
from typing import AsyncIterator

from fastapi import Request

from ..api import GenerationResult, SpeculativeGenerator
from ..config import FuzzyConfig
from ..errors import FSDError
from .engine import Done, EngineLoop, Failed, Job, Piece, QueueFull, emitter
from .protocol import SEED_MAX, SEED_MIN, SamplingFields

FINISH_REASONS = {"eos": "stop", "stop_string": "stop", "max_new_tokens": "length", "context": "length"}
DISCONNECT_POLL_S = 0.5  # how often a non-streaming request checks that its client is still there


class APIError(Exception):
    """An error answered with the OpenAI error body: HTTP ``status``, ``type``, ``param`` and ``code``."""

    def __init__(self, message: str, status: int = 400, type: str = "invalid_request_error",
                 param: str | None = None, code: str | None = None, headers: dict | None = None) -> None:
        super().__init__(message)
        self.message, self.status, self.type, self.param, self.code = message, status, type, param, code
        self.headers = headers or {}

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}


@dataclass
class Settings:
    """What the server serves: the model's name and the tokens of context a request may use (prompt plus
    completion; a request that names no token budget may use the rest of it)."""

    model_name: str
    context: int


class Serving:
    """Requests of both endpoints, on one engine loop."""

    def __init__(self, gen: SpeculativeGenerator, engine: EngineLoop, settings: Settings) -> None:
        self.gen, self.engine, self.settings = gen, engine, settings

    def check(self, req: SamplingFields) -> None:
        field = req.unsupported()
        if field is not None:
            raise APIError(f"{field} is not supported by this server", param=field, code="unsupported_parameter")
        if req.model is not None and req.model != self.settings.model_name:
            raise APIError(f"the model {req.model!r} does not exist; this server serves {self.settings.model_name!r}",
                           status=404, param="model", code="model_not_found")
        if req.stream_options is not None and not req.stream:
            raise APIError("stream_options applies to stream: true", param="stream_options")

    def jobs(self, req: SamplingFields, prompt, chat: bool, streaming: bool) -> tuple[list[Job], asyncio.Queue, int]:
        """One job per choice of ``req`` for ``prompt`` (chat messages, text or token ids), their shared
        event queue (events of choice k come as (k, event)) and the prompt's token count."""
        self.check(req)
        fuzzy = None
        if req.fsd is not None:
            try:
                fuzzy = FuzzyConfig(threshold=req.fsd.threshold, divergence=req.fsd.divergence, mode=req.fsd.mode)
            except FSDError as e:
                raise APIError(str(e), param="fsd") from None
        budget = req.token_budget()
        try:
            ids = self.gen.encode(prompt, chat=chat)
        except FSDError as e:
            raise APIError(str(e), param="messages" if chat else "prompt") from None
        prompt_len = len(ids)
        room = self.settings.context - prompt_len
        if room < 1 or (budget is not None and budget > room):
            raise APIError(f"this model's context is {self.settings.context} tokens; the prompt has {prompt_len} "
                           f"and {budget or 1} more were asked for", param="max_tokens", code="context_length_exceeded")
        base_seed = req.seed if req.seed is not None else secrets.randbits(63)
        loop = asyncio.get_running_loop()
        inbox: asyncio.Queue = asyncio.Queue()
        jobs = []
        for k in range(req.n):
            seed = (base_seed + k - SEED_MIN) % (SEED_MAX - SEED_MIN + 1) + SEED_MIN
            try:
                call = self.gen.prepare(ids, min(budget or room, room), temperature=req.temperature, top_p=req.top_p,
                                        top_k=req.top_k, fuzzy=fuzzy, seed=seed, stop=req.stops(),
                                        autoregressive=not req.speculative, device="cpu")
            except FSDError as e:
                raise APIError(str(e), param=_param_of(str(e))) from None
            if call.clipped and budget is not None:
                raise APIError(f"the prompt has {prompt_len} tokens and {budget} more were asked for: more than the "
                               "model's context leaves", param="max_tokens", code="context_length_exceeded")
            jobs.append(Job(call, streaming, _tagged(emitter(loop, inbox), k)))
        return jobs, inbox, prompt_len

    def submit(self, jobs: list[Job]) -> None:
        if self.engine.failed is not None:
            raise APIError(f"the engine stopped: {self.engine.failed}", status=503, type="server_error")
        try:
            self.engine.submit(jobs)
        except QueueFull as e:
            raise APIError(str(e), status=429, type="rate_limit_error", code="queue_full",
                           headers={"Retry-After": "1"}) from None

    async def results(self, jobs: list[Job], inbox: asyncio.Queue, raw: Request) -> list[GenerationResult]:
        """Every choice's result, in choice order; cancels the jobs if the client goes away meanwhile."""
        results: list[GenerationResult | None] = [None] * len(jobs)
        try:
            while any(r is None for r in results):
                try:
                    k, event = await asyncio.wait_for(inbox.get(), DISCONNECT_POLL_S)
                except asyncio.TimeoutError:
                    if await raw.is_disconnected():
                        raise asyncio.CancelledError from None
                    continue
                if isinstance(event, Failed):
                    raise APIError(event.message, status=500, type="server_error")
                if isinstance(event, Done):
                    results[k] = event.result
        finally:
            if any(r is None for r in results):
                self.engine.cancel(jobs)
        return results  # type: ignore[return-value]

    async def events(self, jobs: list[Job], inbox: asyncio.Queue) -> AsyncIterator[tuple[int, Piece | Done]]:
        """(choice, event) as they come until every choice is done; a failure raises APIError. Leaving
        early (the client went away: the response task is cancelled) cancels the jobs still running."""
        left = len(jobs)
        try:
            while left:
                k, event = await inbox.get()
                if isinstance(event, Failed):
                    raise APIError(event.message, status=500, type="server_error")
                if isinstance(event, Done):
                    left -= 1
                yield k, event
        finally:
            if left:
                self.engine.cancel(jobs)


def usage(prompt_len: int, results: list[GenerationResult]) -> dict:
    """The usage object of a response: token counts and how the choices decoded."""
    completion = sum(r.stats.new_tokens for r in results)
    forwards = sum(r.stats.target_forwards for r in results)
    return {"prompt_tokens": prompt_len * len(results), "completion_tokens": completion,
            "total_tokens": prompt_len * len(results) + completion,
            "speculation": {"tau": round(completion / forwards, 4) if forwards else 0.0, "target_forwards": forwards,
                            "fuzzy_accepted": sum(r.stats.fuzzy_accepted for r in results),
                            "mode": "/".join(sorted({r.stats.mode for r in results}))}}


def sse(obj) -> str:
    """One server-sent event holding ``obj`` (a pydantic model or a dict) as JSON."""
    text = obj.model_dump_json(exclude_none=False) if hasattr(obj, "model_dump_json") else json.dumps(obj)
    return f"data: {text}\n\n"


SSE_DONE = "data: [DONE]\n\n"


def _tagged(emit, k: int):
    return lambda event: emit((k, event))


def _param_of(message: str) -> str | None:
    """The request field an error of the generator is about, where its words name one."""
    for words, param in (("temperature", "temperature"), ("top_p", "top_p"), ("top_k", "top_k"),
                         ("seed", "seed"), ("stop", "stop"), ("prompt", "prompt"), ("max_new_tokens", "max_tokens")):
        if words in message:
            return param
    return None


async def stream_events(serving: Serving, jobs: list[Job], inbox: asyncio.Queue, prompt_len: int,
                        include_usage: bool, chunk, usage_chunk) -> AsyncIterator[str]:
    """The server-sent events of a streaming response: ``chunk(k, text, finish_reason)`` for each piece of
    choice k and once more with its finish reason, then (``include_usage``) ``usage_chunk(usage)``, then
    ``[DONE]``. A failure inside decoding ends the stream with an error event."""
    results: list[GenerationResult | None] = [None] * len(jobs)
    try:
        async for k, event in serving.events(jobs, inbox):
            if isinstance(event, Piece):
                yield sse(chunk(k, event.text, None))
            else:
                results[k] = event.result
                yield sse(chunk(k, "", FINISH_REASONS[event.result.stop_reason]))
    except APIError as e:
        yield sse(e.body())
        yield SSE_DONE
        return
    if include_usage:
        yield sse(usage_chunk(usage(prompt_len, results)))  # type: ignore[arg-type]
    yield SSE_DONE

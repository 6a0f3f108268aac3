"""``POST /v1/completions``: a prompt (text, used as it is, or token ids) in, its continuation out."""

from __future__ import annotations

from fastapi import Request
from fastapi.responses import StreamingResponse

from .protocol import Completion, CompletionChoice, CompletionRequest, new_id, now
from .serving import FINISH_REASONS, Serving, stream_events, usage


async def create_completion(serving: Serving, req: CompletionRequest, raw: Request):
    jobs, inbox, prompt_len = serving.jobs(req, req.prompt, chat=False, streaming=req.stream)
    serving.submit(jobs)
    rid, created, model = new_id("cmpl"), now(), serving.settings.model_name
    if req.stream:
        def chunk(k: int, text: str, finish: str | None) -> Completion:
            return Completion(id=rid, created=created, model=model,
                              choices=[CompletionChoice(index=k, text=text, finish_reason=finish)])

        def usage_chunk(u: dict) -> Completion:
            return Completion(id=rid, created=created, model=model, choices=[], usage=u)

        include = bool(req.stream_options and req.stream_options.include_usage)
        return StreamingResponse(stream_events(serving, jobs, inbox, prompt_len, include, chunk, usage_chunk),
                                 media_type="text/event-stream")
    results = await serving.results(jobs, inbox, raw)
    return Completion(id=rid, created=created, model=model, usage=usage(prompt_len, results), choices=[
        CompletionChoice(index=k, text=r.text, finish_reason=FINISH_REASONS[r.stop_reason])
        for k, r in enumerate(results)])

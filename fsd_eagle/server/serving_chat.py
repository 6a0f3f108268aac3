"""``POST /v1/chat/completions``: a conversation in, the assistant's next message out (the chat template
of the target's tokenizer turns the messages into the prompt)."""

from __future__ import annotations

from fastapi import Request
from fastapi.responses import StreamingResponse

from .protocol import (ChatChoice, ChatChunkChoice, ChatCompletion, ChatCompletionChunk, ChatCompletionRequest, Delta,
                       ResponseMessage, new_id, now)
from .serving import FINISH_REASONS, Serving, stream_events, usage

ROLES = {"developer": "system"}  # OpenAI's newer name for the system role, which chat templates know


def template_messages(req: ChatCompletionRequest) -> list[dict]:
    """The request's messages as the chat template takes them: the role a template knows, the content as one
    string, and the participant's ``name`` where the message has one (templates that use it render it)."""
    return [{"role": ROLES.get(m.role, m.role), "content": m.text(), **({"name": m.name} if m.name else {})}
            for m in req.messages]


async def create_chat_completion(serving: Serving, req: ChatCompletionRequest, raw: Request):
    messages = template_messages(req)
    jobs, inbox, prompt_len = serving.jobs(req, messages, chat=True, streaming=req.stream)
    serving.submit(jobs)
    rid, created, model = new_id("chatcmpl"), now(), serving.settings.model_name
    if req.stream:
        def chunk(k: int, text: str, finish: str | None) -> ChatCompletionChunk:
            delta = Delta(content=text) if finish is None else Delta()
            return ChatCompletionChunk(id=rid, created=created, model=model,
                                       choices=[ChatChunkChoice(index=k, delta=delta, finish_reason=finish)])

        def usage_chunk(u: dict) -> ChatCompletionChunk:
            return ChatCompletionChunk(id=rid, created=created, model=model, choices=[], usage=u)

        async def body():
            for k in range(len(jobs)):  # every choice opens with the role
                yield "data: " + ChatCompletionChunk(id=rid, created=created, model=model, choices=[
                    ChatChunkChoice(index=k, delta=Delta(role="assistant", content=""))]).model_dump_json() + "\n\n"
            include = bool(req.stream_options and req.stream_options.include_usage)
            async for event in stream_events(serving, jobs, inbox, prompt_len, include, chunk, usage_chunk):
                yield event

        return StreamingResponse(body(), media_type="text/event-stream")
    results = await serving.results(jobs, inbox, raw)
    return ChatCompletion(id=rid, created=created, model=model, usage=usage(prompt_len, results), choices=[
        ChatChoice(index=k, message=ResponseMessage(content=r.text), finish_reason=FINISH_REASONS[r.stop_reason])
        for k, r in enumerate(results)])

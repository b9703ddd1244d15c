"""`POST /v1/completions` and `POST /v1/chat/completions`: OpenAI's shapes, plus a `kite` field
that names a state (or a document to upcycle first) and a `kite` object in the response saying
what YOCO decided, what it loaded, the measured gain and the timings."""

from __future__ import annotations

import asyncio
import json
import time
import uuid

from fastapi import APIRouter, Depends, Request
from fastapi.responses import StreamingResponse

from kite.errors import BadInput, KiteError
from kite.serve.errors import error_response
from kite.serve.batcher import Leaving, LoopText
from kite.serve.runner import GenOptions
from kite.serve.schemas import ChatRequest, CompletionRequest
from kite.serve.auth import authenticate
from kite.serve.tenants import scoped
from kite.serve.workers import on_model

router = APIRouter(dependencies=[Depends(authenticate)])


def _apply_stops(text: str, stops: list[str], stop_reason: str) -> tuple[str, str]:
    cut = min((i for i in (text.find(s) for s in stops) if i >= 0), default=-1)
    if cut >= 0:
        return text[:cut], "stop"
    return text, "stop" if stop_reason == "eos" else "length"


async def _prepare(request: Request, body, chat: bool):
    """Resolve the state (upcycling a document first) to its file, the prompt's ids and generation
    options, in the view of the request's tenant (kite.serve.tenants)."""
    srv = scoped(request)
    state_id = upcycled = path = None
    if body.kite is not None:
        if body.kite.document is not None:
            upcycled = await on_model(srv, srv.runner.upcycle, body.kite.document, None, body.kite.name or "-")
            srv.metrics.observe_upcycle(upcycled)
            state_id = upcycled.summary.id
        else:
            state_id = body.kite.state
        path = srv.store.usable(state_id)  # a bad, unknown or quarantined id is refused before any work
    limit = srv.settings.max_tokens_limit
    max_new = body.max_completion_tokens or body.max_tokens or srv.settings.default_max_tokens
    if max_new > limit:
        raise BadInput(f"max_tokens {max_new}: at most {limit} on this server")
    if chat:
        prompt_ids = srv.runner.encode_chat(body.template_messages())
        query = body.query
    else:
        try:
            query = body.prompt_text
        except ValueError as exc:
            raise BadInput(str(exc)) from None
        prompt_ids = srv.runner.encode(query, after_state=state_id is not None)
    if not prompt_ids:
        raise BadInput("the prompt is empty")
    opts = GenOptions(max_new_tokens=max_new, temperature=body.temperature, top_p=body.top_p, seed=body.seed,
                      queued_at=time.perf_counter())
    return srv, (state_id, path), upcycled, prompt_ids, query, opts


def _usage(answer) -> dict:
    g = answer.generation
    return {"prompt_tokens": g.prompt_tokens, "completion_tokens": g.new_tokens,
            "total_tokens": g.prompt_tokens + g.new_tokens, "prefix_tokens": g.prefix_tokens}


def _kite(srv, answer, upcycled) -> dict:
    out = answer.kite_dict(srv.settings.fusion)
    if upcycled is not None:
        out["upcycled"] = upcycled.to_dict()
    return out


def _choice(chat: bool, text: str, finish: str) -> dict:
    if chat:
        return {"index": 0, "message": {"role": "assistant", "content": text}, "finish_reason": finish}
    return {"index": 0, "text": text, "logprobs": None, "finish_reason": finish}


def _unknown_model(srv, name: str | None):
    """OpenAI's answer to a model this server does not serve (404, code `model_not_found`), or None.
    No `model` at all means the served one."""
    names = srv.runner.model_names
    if name is None or name in names:
        return None
    also = f" (or {', '.join(repr(n) for n in names[1:])})" if len(names) > 1 else ""
    return error_response(404, f"The model {name!r} does not exist on this server: it serves {names[0]!r}{also}",
                          type="invalid_request_error", param="model", code="model_not_found")


async def _respond(request: Request, body, chat: bool):
    t0 = time.perf_counter()
    refusal = _unknown_model(request.app.state.kite, body.model)
    if refusal is not None:
        return refusal
    # a stopped model is refused with its status line, before a stream would have sent 200
    request.app.state.kite.runner.batcher.check_running()
    srv, (state_id, path), upcycled, prompt_ids, query, opts = await _prepare(request, body, chat)
    rid = ("chatcmpl-" if chat else "cmpl-") + uuid.uuid4().hex[:24]
    head = {"id": rid, "object": "chat.completion" if chat else "text_completion", "created": int(time.time()),
            "model": srv.runner.model_name}
    if body.stream:
        return StreamingResponse(_stream(srv, head, chat, prompt_ids, query, state_id, path, opts, upcycled),
                                 media_type="text/event-stream", headers={"cache-control": "no-cache"})
    answer = await on_model(srv, srv.runner.answer, prompt_ids, query, state_id, opts, path)
    srv.metrics.observe_answer(answer)
    text, finish = _apply_stops(answer.generation.text, body.stops, answer.generation.stop_reason)
    kite = _kite(srv, answer, upcycled)
    kite.setdefault("timings_ms", {})["request"] = round((time.perf_counter() - t0) * 1e3, 3)
    return {**head, "choices": [_choice(chat, text, finish)], "usage": _usage(answer), "kite": kite}


async def _stream(srv, head, chat, prompt_ids, query, state_id, path, opts, upcycled):
    """Server-sent events: one chunk per piece of decoded text, then a last chunk with the finish
    reason, usage and the `kite` object, then `data: [DONE]`. (`stop` strings are not applied
    to a stream: the text has already gone out.)"""
    loop = asyncio.get_running_loop()
    queue: asyncio.Queue = asyncio.Queue()
    opts.on_text = LoopText(loop, queue)
    leaving = Leaving(srv.runner.batcher)   # a client that goes away is cancelled at the next step
    opts.on_request = leaving.attach
    obj = "chat.completion.chunk" if chat else "text_completion"
    task = asyncio.ensure_future(on_model(srv, srv.runner.answer, prompt_ids, query, state_id, opts, path))
    task.add_done_callback(lambda _: loop.call_soon(queue.put_nowait, None))

    def event(choice: dict, **extra) -> str:
        return "data: " + json.dumps({**head, "object": obj, "choices": [choice], **extra}) + "\n\n"

    first = True
    try:
        while True:
            piece = await queue.get()
            if piece is None:
                break
            while not queue.empty():   # pieces that came while the last one was sent go out as one
                more = queue.get_nowait()
                if more is None:
                    queue.put_nowait(None)
                    break
                piece += more
            if chat:
                delta = {"role": "assistant", "content": piece} if first else {"content": piece}
                yield event({"index": 0, "delta": delta, "finish_reason": None})
            else:
                yield event({"index": 0, "text": piece, "logprobs": None, "finish_reason": None})
            first = False
    finally:
        if not task.done():   # the client left mid-stream
            leaving.leave()
            task.add_done_callback(lambda t: t.cancelled() or t.exception())   # nobody reads it now
    try:
        answer = task.result()
    except Exception as exc:  # noqa: BLE001 - the status line has gone; report in the stream
        from kite.serve.errors import status_of

        status = status_of(exc) if isinstance(exc, KiteError) else 500
        yield "data: " + json.dumps({"error": {"message": str(exc).splitlines()[0] if str(exc) else
                                               type(exc).__name__, "code": status}}) + "\n\n"
        yield "data: [DONE]\n\n"
        return
    srv.metrics.observe_answer(answer)
    finish = "stop" if answer.generation.stop_reason == "eos" else "length"
    last = {"index": 0, "delta": {}, "finish_reason": finish} if chat else \
        {"index": 0, "text": "", "logprobs": None, "finish_reason": finish}
    yield event(last, usage=_usage(answer), kite=_kite(srv, answer, upcycled))
    yield "data: [DONE]\n\n"


@router.post("/v1/completions")
async def completions(request: Request, body: CompletionRequest):
    return await _respond(request, body, chat=False)


@router.post("/v1/chat/completions")
async def chat_completions(request: Request, body: ChatRequest):
    return await _respond(request, body, chat=True)


@router.get("/v1/models")
async def models(request: Request):
    srv = request.app.state.kite
    return {"object": "list", "data": [{"id": srv.runner.model_name, "object": "model", "owned_by": "kite",
                                        "fingerprint": srv.runner.lm.fingerprints.combined}]}

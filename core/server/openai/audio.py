"""``POST /v1/audio/transcriptions`` and ``/v1/audio/translations``, as OpenAI's reference.

A multipart form: ``file`` (the audio), ``model``, ``language`` (transcriptions), ``prompt``,
``temperature``, ``response_format`` (json, text, srt, vtt, verbose_json),
``timestamp_granularities[]`` and ``stream`` (``transcript.text.delta`` events, then one
``transcript.text.done``). The form is parsed in memory: the upload's part never spools to a
temporary file (every part is under the body cap, which the spool threshold is set above), and
decoding runs in a worker thread, off the event loop. A server whose model takes no audio answers
400.
"""

from __future__ import annotations

import asyncio
import json

from fastapi import APIRouter
from fastapi import Request as HTTPRequest
from fastapi.responses import JSONResponse, PlainTextResponse, StreamingResponse
from starlette.datastructures import UploadFile
from starlette.formparsers import MultiPartException, MultiPartParser

from llmkit.core.audio.decode import AudioError, AudioLimits, decode_audio
from llmkit.core.server.errors import APIError
from llmkit.core.server.model_names import is_served, model_not_found
from llmkit.core.server.openai import transcript_formats as fmt
from llmkit.core.server.state import ServerState

_FIELDS = 32  # the form's fields: OpenAI's are a dozen


def _parser(max_body: int):
    class InMemoryParser(MultiPartParser):
        spool_max_size = max_body + 1  # above the body cap: no part ever rolls over to disk

    return InMemoryParser


async def _form(raw: HTTPRequest, max_body: int):
    if not raw.headers.get("content-type", "").startswith("multipart/form-data"):
        raise APIError("The request must be multipart/form-data with the audio in `file`.", 400)
    try:
        return await _parser(max_body)(raw.headers, raw.stream(), max_files=1, max_fields=_FIELDS).parse()
    except MultiPartException as exc:
        raise APIError(f"The multipart form could not be read: {exc.message}", 400) from None


def _field(form, name: str, default=None):
    value = form.get(name)
    if value is None or value == "":
        return default
    if isinstance(value, UploadFile):
        raise APIError(f"`{name}` must be a form field, not a file.", 400, param=name)
    return value


def _temperature(form) -> float:
    raw = _field(form, "temperature", "0")
    try:
        value = float(raw)
    except ValueError:
        raise APIError(f"`temperature` must be a number (got {raw!r}).", 400, param="temperature") from None
    if not 0.0 <= value <= 1.0:
        raise APIError("`temperature` must be between 0 and 1.", 400, param="temperature")
    return value


def audio_router(state: ServerState) -> APIRouter:
    router = APIRouter()

    async def handle(raw: HTTPRequest, task: str):
        speech = state.speech
        if speech is None:
            raise APIError(
                f"The model `{state.options.served_model_name}` does not take audio: serve a speech-to-text "
                "model (Whisper) for /v1/audio routes.",
                400,
                param="model",
                code="model_not_audio",
            )
        opts = state.options
        form = await _form(raw, opts.max_payload_size)
        upload = form.get("file")
        if not isinstance(upload, UploadFile):
            raise APIError("`file` is required: the audio, as a file part of the form.", 400, param="file")
        model = _field(form, "model")
        if model is None:
            raise APIError("`model` is required.", 400, param="model")
        if not is_served(opts, model):
            raise model_not_found(opts, model)
        response_format = _field(form, "response_format", "json")
        if response_format not in fmt.FORMATS:
            raise APIError(
                f"`response_format` must be one of {', '.join(fmt.FORMATS)} (got {response_format!r}).",
                400,
                param="response_format",
            )
        granularities = form.getlist("timestamp_granularities[]") or form.getlist("timestamp_granularities")
        for g in granularities:
            if g not in ("segment", "word"):
                raise APIError(f"Unknown timestamp granularity {g!r}.", 400, param="timestamp_granularities")
        if granularities and response_format != "verbose_json":
            raise APIError(
                "`timestamp_granularities[]` needs response_format verbose_json.", 400, param="timestamp_granularities"
            )
        if "word" in granularities:
            raise APIError(
                "Word timestamps are not served yet; ask for segment ones.", 400, param="timestamp_granularities"
            )
        stream = str(_field(form, "stream", "false")).lower() == "true"
        if stream and response_format not in ("json", "text"):
            raise APIError("Streaming gives json or text transcripts.", 400, param="stream")
        temperature = _temperature(form)
        language = _field(form, "language") if task == "transcribe" else None
        prompt = _field(form, "prompt")
        data = await upload.read()
        limits = AudioLimits(opts.max_audio_bytes, opts.max_audio_seconds)
        try:
            samples = await asyncio.to_thread(decode_audio, data, speech.sample_rate, limits)
        except AudioError as exc:
            raise APIError(str(exc), exc.status, param="file", code=exc.code) from None
        del data, form  # the encoded upload is not needed past decoding
        previous = state.tokenizer.encode(" " + prompt.strip(), add_special_tokens=False) if prompt else []
        loop = asyncio.get_running_loop()
        deltas: asyncio.Queue = asyncio.Queue()
        on_window = (lambda seg: loop.call_soon_threadsafe(deltas.put_nowait, seg)) if stream else None
        try:
            future = speech.transcribe(
                samples, task=task, language=language, previous=previous, temperature=temperature, on_window=on_window
            )
        except ValueError as exc:
            raise APIError(str(exc), 400, param="language") from None
        if stream:
            return StreamingResponse(_events(future, deltas), media_type="text/event-stream")
        try:
            transcript = await asyncio.wrap_future(future)
        except asyncio.CancelledError:
            future.cancel()
            raise
        if response_format == "text":
            return PlainTextResponse(transcript.text + "\n")
        if response_format == "srt":
            return PlainTextResponse(fmt.srt(transcript))
        if response_format == "vtt":
            return PlainTextResponse(fmt.vtt(transcript), media_type="text/vtt")
        if response_format == "verbose_json":
            body = fmt.verbose_json(transcript, "transcribe" if task == "transcribe" else "translate", temperature)
            if granularities:
                body["segments"] = body["segments"] if "segment" in granularities else []
            return JSONResponse(body)
        usage = {"type": "duration", "seconds": max(1, round(transcript.duration))}
        return JSONResponse({"text": transcript.text, "usage": usage})

    async def _events(future, deltas: asyncio.Queue):
        def event(body: dict) -> str:
            return f"data: {json.dumps(body)}\n\n"

        done = asyncio.wrap_future(future)
        try:
            async for chunk in _deltas(done, deltas, event):
                yield chunk
        finally:  # the client went away mid-stream: the engine decodes no further window for it
            future.cancel()

    async def _deltas(done, deltas: asyncio.Queue, event):
        first = True
        while not (done.done() and deltas.empty()):
            getter = asyncio.ensure_future(deltas.get())
            finished, _ = await asyncio.wait({getter, done}, return_when=asyncio.FIRST_COMPLETED)
            if getter in finished:
                seg = getter.result()
                text = seg.text.lstrip() if first else seg.text
                first = first and not text
                if text:
                    yield event({"type": "transcript.text.delta", "delta": text, "logprobs": None})
            else:
                getter.cancel()
        try:
            transcript = done.result()
        except Exception as exc:  # noqa: BLE001 (the stream has begun: the error is its last event)
            yield event({"type": "error", "error": {"message": str(exc), "type": "internal_server_error"}})
            return
        usage = {"type": "duration", "seconds": max(1, round(transcript.duration))}
        yield event({"type": "transcript.text.done", "text": transcript.text, "logprobs": None, "usage": usage})

    @router.post("/v1/audio/transcriptions")
    async def transcriptions(raw: HTTPRequest):
        return await handle(raw, "transcribe")

    @router.post("/v1/audio/translations")
    async def translations(raw: HTTPRequest):
        return await handle(raw, "translate")

    return router

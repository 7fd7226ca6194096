"""``/v1/audio/transcriptions`` and ``/translations`` on a real ``llmkit serve`` of a tiny Whisper,
through the official ``openai`` client in every response format and streaming; its text equals
transformers' ``generate`` on the same features; bad uploads get OpenAI-shaped 4xx and the server
serves on; a model without audio answers 400."""

from __future__ import annotations

import http.client
import json
import re
import socket

import openai
import pytest
import torch

from llmkit.core.audio.decode import decode_audio
from llmkit.core.audio.features import WhisperFeatures

from audio_utils import encode, speech
from server_utils import start_server, stop_server
from whisper_utils import tiny_whisper

MAX_AUDIO_BYTES = 2_000_000


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    path = tmp_path_factory.mktemp("whisper")
    reference = tiny_whisper(path)
    proc, base_url = start_server(
        ["--model-path", str(path), "--max-audio-bytes", str(MAX_AUDIO_BYTES), "--max-audio-seconds", "90"]
    )
    try:
        yield reference, path, base_url
    finally:
        stop_server(proc)


@pytest.fixture(scope="module")
def client(served) -> openai.OpenAI:
    return openai.OpenAI(base_url=served[2] + "/v1", api_key="none", max_retries=0)


@pytest.fixture(scope="module")
def upload() -> bytes:
    samples, rate = speech("The quick brown fox jumps over the lazy dog.")
    return encode(samples, rate, "mp3")


def test_json_text_equals_transformers_generate(served, client, upload):
    reference, path, _ = served
    from transformers import AutoTokenizer

    features = WhisperFeatures()([torch.from_numpy(decode_audio(upload, 16000))])
    limit = reference.config.max_target_positions - 4
    ids = reference.generate(features, language="en", task="transcribe", max_new_tokens=limit)[0].tolist()
    eos = reference.generation_config.eos_token_id
    ids = (ids[: ids.index(eos)] if eos in ids else ids)[:limit]
    expected = AutoTokenizer.from_pretrained(path).decode(ids, skip_special_tokens=True).strip()
    got = client.audio.transcriptions.create(model="m", file=("speech.mp3", upload), language="en")
    assert got.text == expected and got.text
    assert got.usage.type == "duration" and got.usage.seconds == 3


def test_every_response_format(client, upload):
    text = client.audio.transcriptions.create(model="m", file=("a.mp3", upload), language="en").text
    plain = client.audio.transcriptions.create(model="m", file=("a.mp3", upload), language="en", response_format="text")
    assert plain.strip() == text
    srt = client.audio.transcriptions.create(model="m", file=("a.mp3", upload), language="en", response_format="srt")
    assert re.fullmatch(r"1\n00:00:00,000 --> 00:00:02,7\d\d\n.+\n", srt), srt
    assert srt.splitlines()[2] == text
    vtt = client.audio.transcriptions.create(model="m", file=("a.mp3", upload), language="en", response_format="vtt")
    assert re.fullmatch(r"WEBVTT\n\n00:00:00\.000 --> 00:00:02\.7\d\d\n.+\n", vtt), vtt
    verbose = client.audio.transcriptions.create(
        model="m",
        file=("a.mp3", upload),
        language="en",
        response_format="verbose_json",
        timestamp_granularities=["segment"],
    )
    assert verbose.language == "english" and verbose.text == text
    assert verbose.duration == pytest.approx(2.78, abs=0.05)
    [segment] = verbose.segments
    assert (segment.id, segment.start, segment.end) == (0, 0.0, verbose.duration) and segment.text.strip() == text


def test_long_audio_is_windowed_with_monotone_segments(client):
    samples, rate = speech("One long recording. " * 12)  # about 13 s, repeated to 65 s
    long = encode(torch.from_numpy(samples).repeat(5).numpy()[: 65 * rate], rate, "opus")
    verbose = client.audio.transcriptions.create(
        model="m", file=("long.ogg", long), language="en", response_format="verbose_json"
    )
    starts = [s.start for s in verbose.segments]
    assert starts == [0.0, 30.0, 60.0] and [s.end for s in verbose.segments][:2] == [30.0, 60.0]
    assert verbose.segments[-1].end == pytest.approx(65.0, abs=0.05)
    assert verbose.text == "".join(s.text for s in verbose.segments).strip()
    srt = client.audio.transcriptions.create(model="m", file=("long.ogg", long), language="en", response_format="srt")
    assert [line for line in srt.splitlines() if "-->" in line][1] == "00:00:30,000 --> 00:01:00,000"


def test_streaming_deltas_then_done(client, upload):
    text = client.audio.transcriptions.create(model="m", file=("a.mp3", upload), language="en").text
    events = list(client.audio.transcriptions.create(model="m", file=("a.mp3", upload), language="en", stream=True))
    assert [e.type for e in events[:-1]] == ["transcript.text.delta"] * (len(events) - 1) and len(events) >= 2
    assert events[-1].type == "transcript.text.done" and events[-1].text == text
    assert "".join(e.delta for e in events[:-1]) == text


@pytest.mark.filterwarnings("ignore::DeprecationWarning")  # the client marks translations deprecated
def test_translation_and_language_detection(client, upload):
    translated = client.audio.translations.create(model="m", file=("a.mp3", upload))
    assert isinstance(translated.text, str) and translated.text
    detected = client.audio.transcriptions.create(model="m", file=("a.mp3", upload), response_format="verbose_json")
    assert detected.language  # whatever the random weights pick, named in words


@pytest.mark.parametrize(
    "data, status, code",
    [
        (b"", 400, "empty_file"),
        (b"not audio at all " * 50, 400, "invalid_audio"),
        (b"RIFF", 400, "invalid_audio"),
        (b"\x00" * (MAX_AUDIO_BYTES + 1), 413, "file_too_large"),
    ],
    ids=["empty", "not-audio", "cut-header", "too-big"],
)
def test_bad_uploads_are_4xx_and_the_server_serves_on(served, client, upload, data, status, code):
    with pytest.raises(openai.APIStatusError) as caught:
        client.audio.transcriptions.create(model="m", file=("x.wav", data))
    assert caught.value.status_code == status
    assert caught.value.body["code"] == code and caught.value.body["param"] == "file"
    assert client.audio.transcriptions.create(model="m", file=("a.mp3", upload), language="en").text


def test_truncated_too_long_and_bad_fields(client, upload):
    samples, rate = speech("The quick brown fox jumps over the lazy dog.")
    wav = encode(samples, rate, "wav")
    with pytest.raises(openai.BadRequestError, match="truncated"):
        client.audio.transcriptions.create(model="m", file=("cut.wav", wav[: len(wav) // 2]))
    minutes = encode(torch.zeros(100 * 8000).numpy(), 8000, "flac")
    with pytest.raises(openai.BadRequestError, match="--max-audio-seconds"):
        client.audio.transcriptions.create(model="m", file=("long.flac", minutes))
    with pytest.raises(openai.BadRequestError, match="response_format"):
        client.audio.transcriptions.create(model="m", file=("a.mp3", upload), response_format="xml")
    with pytest.raises(openai.BadRequestError, match="ISO-639-1"):
        client.audio.transcriptions.create(model="m", file=("a.mp3", upload), language="klingon")
    with pytest.raises(openai.BadRequestError, match="Word timestamps"):
        client.audio.transcriptions.create(
            model="m", file=("a.mp3", upload), response_format="verbose_json", timestamp_granularities=["word"]
        )
    with pytest.raises(openai.NotFoundError):
        client.audio.transcriptions.create(model="other", file=("a.mp3", upload))


def test_a_two_gigabyte_upload_is_refused_before_it_is_read(served):
    # the declared length alone is refused (413) by the body cap: a raw socket sends only headers
    host, port = served[2].removeprefix("http://").split(":")
    with socket.create_connection((host, int(port)), timeout=30) as sock:
        sock.sendall(
            b"POST /v1/audio/transcriptions HTTP/1.1\r\nHost: x\r\n"
            b"Content-Type: multipart/form-data; boundary=b\r\nContent-Length: %d\r\n\r\n" % (2 << 30)
        )
        reply = http.client.HTTPResponse(sock)
        reply.begin()
        assert reply.status == 413 and json.loads(reply.read())["error"]["code"] == "payload_too_large"


def test_generation_routes_say_the_model_transcribes(client):
    with pytest.raises(openai.BadRequestError, match="transcribes speech"):
        client.chat.completions.create(model="m", messages=[{"role": "user", "content": "hi"}])


def test_a_model_without_audio_answers_400(upload):
    from fastapi.testclient import TestClient

    from fake_engine import fake_app

    with TestClient(fake_app()) as http:
        r = http.post("/v1/audio/transcriptions", files={"file": ("a.mp3", upload)}, data={"model": "m"})
    assert r.status_code == 400
    error = r.json()["error"]
    assert error["code"] == "model_not_audio" and "does not take audio" in error["message"]
    assert json.dumps(error)  # OpenAI's shape: message, type, param, code
    assert set(error) == {"message", "type", "param", "code"}

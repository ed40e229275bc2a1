"""Request checking without a server: every refusal names its field and reason."""

import math

import pytest

from specpair._proto import engine_pb2 as pb
from specpair.server.client import request
from specpair.server.requests import (CheckedRequest, InvalidField, Limits, RequestFields, check_context,
                                      check_fields, find_invalid_utf8, float32_as_written, generate_fields)

LIMITS = Limits(max_new_tokens=100)


def check_generate(request, limits: Limits, vocab_size: int | None = None) -> CheckedRequest:
    """A GenerateRequest checked as the gRPC service checks one: read as its client wrote it, then
    the checks both protocols share."""
    return check_fields(generate_fields(request), limits, vocab_size=vocab_size)


def refused(req) -> InvalidField:
    with pytest.raises(InvalidField) as info:
        check_generate(req, LIMITS)
    return info.value


@pytest.mark.parametrize("req, field, words", [
    (pb.GenerateRequest(), "prompt", "empty prompt"),
    (request("   \n"), "prompt", "empty prompt"),
    (pb.GenerateRequest(prompt_utf8=b""), "prompt_utf8", "empty prompt"),
    (request([]), "chat.messages", "empty prompt"),
    (request("hi", max_new_tokens=0), "max_new_tokens", ">= 1, got 0"),
    (request("hi", max_new_tokens=-5), "max_new_tokens", ">= 1, got -5"),
    (request("hi", max_new_tokens=101), "max_new_tokens", "limit of 100"),
    (request("hi", temperature=-0.5), "temperature", ">= 0"),
    (request("hi", temperature=float("nan")), "temperature", "finite"),
    (request("hi", temperature=1e-6), "temperature", "greedy"),
    (request("hi", top_p=0.0), "top_p", "(0, 1]"),
    (request("hi", top_p=1.5), "top_p", "(0, 1]"),
    (request("hi", top_p=float("nan")), "top_p", "(0, 1]"),
    (request("hi", top_k=-1), "top_k", ">= 0"),
    (request([{"role": "user", "content": "hi"}, {"role": "wizard", "content": "x"}]),
     "chat.messages[1].role", "unknown chat role 'wizard'"),
    (request([{"role": "user", "content": " "}]), "chat.messages", "empty"),
    (request("hi", stop=[""]), "stop[0]", "empty stop string"),
    (request("hi", stop=["x"] * 17), "stop", "at most 16"),
    (request("hi", stop=["x" * 300]), "stop[0]", "at most 256"),
    (request("hi", category="bad label!"), "category", "A-Z"),
    (request("hi", speculation_k=99), "speculation.k", "<= 16"),
    (pb.GenerateRequest(prompt_utf8=b"ok \xff\xfe"), "prompt_utf8", "malformed UTF-8: byte 0xff at offset 3"),
])
def test_bad_request_names_field_and_reason(req, field, words):
    err = refused(req)
    assert err.field == field
    assert words in err.reason
    assert str(err).startswith(f"{field}: ")


def test_good_request_maps_to_generation_params():
    checked = check_generate(request([{"role": "system", "content": "be brief"},
                                      {"role": "user", "content": "hi"}],
                                     max_new_tokens=7, temperature=0.7, top_k=5, top_p=0.9, seed=3,
                                     stop=["\n"], speculation_k=0, category="code"), LIMITS)
    assert checked.chat and checked.prompt[1] == {"role": "user", "content": "hi"}
    p = checked.params
    assert (p.max_new_tokens, p.top_k, p.seed, p.stop, p.speculation_k, p.category) == (7, 5, 3, ("\n",), 0, "code")
    assert p.temperature == pytest.approx(0.7) and p.top_p == pytest.approx(0.9)
    defaults = check_generate(request("hi"), LIMITS).params
    assert (defaults.max_new_tokens, defaults.temperature, defaults.speculation_k, defaults.category) == \
        (64, 0.0, None, "general")
    assert check_generate(pb.GenerateRequest(prompt_utf8="héllo".encode()), LIMITS).prompt == "héllo"


def test_context_checks_blame_the_right_field():
    check_context(10, 20, 64, "prompt")
    with pytest.raises(InvalidField, match="^prompt: prompt has 64 tokens; the model's context is 64"):
        check_context(64, 1, 64, "prompt")
    with pytest.raises(InvalidField, match="^max_new_tokens: 60 new tokens after a 10-token prompt"):
        check_context(10, 60, 64, "chat")


def _with_raw_string(message: bytes, field_number: int, payload: bytes) -> bytes:
    """Append a length-delimited field carrying bytes protobuf would refuse as a string."""
    return message + bytes([field_number << 3 | 2, len(payload)]) + payload


def test_find_invalid_utf8_names_top_level_and_nested_fields():
    bad = b"caf\xc3"   # truncated 2-byte sequence
    raw = _with_raw_string(request("hi", max_new_tokens=3).SerializeToString(), 12, bad)   # category
    assert find_invalid_utf8(raw, pb.GenerateRequest.DESCRIPTOR) == "category"

    good = pb.ChatMessage(role="user", content="fine").SerializeToString()
    broken = _with_raw_string(b"", 1, b"user") + _with_raw_string(b"", 2, bad)
    messages = _with_raw_string(_with_raw_string(b"", 1, good), 1, broken)   # ChatMessages
    raw = _with_raw_string(b"", 3, messages)                                   # GenerateRequest.chat
    assert find_invalid_utf8(raw, pb.GenerateRequest.DESCRIPTOR) == "chat.messages[1].content"

    raw = _with_raw_string(b"", 10, b"ok") + _with_raw_string(b"", 10, b"\xff")   # stop[1]
    assert find_invalid_utf8(raw, pb.GenerateRequest.DESCRIPTOR) == "stop[1]"
    assert find_invalid_utf8(request("fine").SerializeToString(), pb.GenerateRequest.DESCRIPTOR) is None
    assert find_invalid_utf8(b"\x12\x7f", pb.GenerateRequest.DESCRIPTOR) is None   # truncated, not UTF-8


def test_float32_fields_are_read_as_their_client_wrote_them():
    # 0.01 travels as float32 0.0099999998: the documented lower bound must still be accepted.
    wire = pb.GenerateRequest(prompt="hi", temperature=0.01, top_p=0.9)
    assert wire.temperature != 0.01
    assert float32_as_written(wire.temperature) == 0.01
    params = check_generate(wire, LIMITS).params
    assert (params.temperature, params.top_p) == (0.01, 0.9)
    for value in (1.0, 100.0, 0.7, 1e-6, 3.4e38, float("inf")):
        wire.temperature = value
        assert float32_as_written(wire.temperature) == value
    assert math.isnan(float32_as_written(float("nan")))
    assert "temperature" in str(refused(request("hi", temperature=0.00999)))


@pytest.mark.parametrize("fields, field, words", [
    (RequestFields(prompt="hi", top_k=401), "top_k", "vocabulary size 400"),
    (RequestFields(prompt="hi", top_k=2 ** 63), "top_k", "vocabulary size 400"),
    (RequestFields(prompt="hi", seed=2 ** 64), "seed", "[0, 2**64)"),
    (RequestFields(prompt="hi", seed=-1), "seed", "[0, 2**64)"),
    (RequestFields(prompt="hi", max_new_tokens=2 ** 63), "max_new_tokens", "limit of 100"),
    (RequestFields(prompt="hi", max_new_tokens=True), "max_new_tokens", "must be an integer"),
    (RequestFields(prompt="hi", top_k=1.5), "top_k", "must be an integer"),
    (RequestFields(prompt="hi", speculation_k="3"), "speculation.k", "must be an integer"),
    (RequestFields(prompt="hi", temperature="hot"), "temperature", "must be a number"),
    (RequestFields(prompt="ab\ud800"), "prompt", "U+D800 at character 2"),
    (RequestFields(messages=[("user", "fine"), ("user", "\udfff")]), "chat.messages[1].content", "not valid Unicode"),
    (RequestFields(prompt="hi", stop=("ok", "\ud83d")), "stop[1]", "not valid Unicode"),
    (RequestFields(prompt="hi", request_id="\ud800"), "request_id", "not valid Unicode"),
])
def test_every_field_is_checked_against_the_range_it_becomes(fields, field, words):
    with pytest.raises(InvalidField) as info:
        check_fields(fields, LIMITS, vocab_size=400)
    assert info.value.field == field and words in info.value.reason, info.value


def test_the_top_k_and_surrogate_bounds_admit_what_is_valid():
    assert check_fields(RequestFields(prompt="hi", top_k=400), LIMITS, vocab_size=400).params.top_k == 400
    text = "h\U0001F600 \u00e9"     # outside the BMP and accented: valid, however it is written
    assert check_fields(RequestFields(prompt=text), LIMITS, vocab_size=400).prompt == text

"""The daemon protocol, sans I/O: framing (``FrameDecoder``/``encode_frame``) and request schemas.

Nothing here opens a socket. Expectations come from docs/protocol.md: a frame is a big-endian
u32 length and a msgpack map; an oversized length prefix is a fatal ProtocolError raised before
the body is buffered; a body that is not a map (or not decodable) is a non-fatal ProtocolError
and decoding continues with the next frame; schema errors name the field at fault.
"""

from __future__ import annotations

import struct

import msgpack
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from ectier.daemon.protocol import (
    DEFAULT_MAX_FRAME_BYTES,
    OPS,
    PROTOCOL_VERSION,
    FrameDecoder,
    ProtocolError,
    Request,
    encode_frame,
    error_reply,
    ok_reply,
    parse_request,
)


def frame(body: bytes) -> bytes:
    """A frame built by hand (independent of encode_frame)."""
    return struct.pack(">I", len(body)) + body


GET = {"id": 7, "op": "get", "key": "mm-hash-1", "namespace": "qwen3-vl"}
RESERVE = {"id": 8, "op": "reserve", "key": "k", "dtype": "bfloat16", "shape": [2040, 8192]}


# ================================================================================== framing


def test_encode_frame_layout():
    data = encode_frame(GET)
    (length,) = struct.unpack(">I", data[:4])
    assert length == len(data) - 4
    assert msgpack.unpackb(data[4:], raw=False) == GET


def test_round_trip_several_frames_in_one_feed():
    msgs = [GET, RESERVE, {"id": 9, "op": "ping"}, {"id": 10, "op": "stats"}]
    dec = FrameDecoder()
    assert dec.feed(b"".join(encode_frame(m) for m in msgs)) == msgs
    assert dec.pending_bytes == 0


def test_incremental_feed_byte_by_byte():
    msgs = [GET, RESERVE, {"id": 11, "op": "hello", "version": PROTOCOL_VERSION, "client": "é✓"}]
    data = b"".join(encode_frame(m) for m in msgs)
    dec = FrameDecoder()
    out = []
    for i in range(len(data)):
        got = dec.feed(data[i:i + 1])
        out.extend(got)
        # a message comes out exactly when its last byte arrives, never before
        assert dec.pending_bytes == (i + 1) - sum(len(encode_frame(m)) for m in out)
    assert out == msgs
    assert dec.feed(b"") == []


def test_split_length_prefix_waits():
    data = encode_frame(GET)
    dec = FrameDecoder()
    assert dec.feed(data[:3]) == []
    assert dec.pending_bytes == 3
    assert dec.feed(data[3:]) == [GET]


def test_frame_at_the_cap_is_accepted_and_one_byte_more_is_fatal():
    cap = 4096
    body = msgpack.packb({"id": 1, "op": "ping", "pad": "x" * 1000})  # str16 header either way
    body = msgpack.packb({"id": 1, "op": "ping", "pad": "x" * (1000 + cap - len(body))})
    assert len(body) == cap
    assert FrameDecoder(cap).feed(frame(body)) == [msgpack.unpackb(body)]
    with pytest.raises(ProtocolError) as ei:
        FrameDecoder(cap - 1).feed(frame(body))
    assert ei.value.fatal


def test_oversized_length_prefix_is_fatal_before_the_body_arrives():
    dec = FrameDecoder(1 << 16)
    # only the 4-byte prefix: the decoder must refuse now, not wait for 4 GiB of body
    with pytest.raises(ProtocolError) as ei:
        dec.feed(b"\xff\xff\xff\xff")
    assert ei.value.fatal
    assert "exceeds" in str(ei.value)
    assert dec.pending_bytes == 0  # nothing buffered


def test_oversized_frame_after_a_good_one():
    """The message before the bad frame is returned (it is answered first); the error is kept in
    ``fatal`` and raised by every later feed."""
    dec = FrameDecoder(1 << 16)
    assert dec.feed(encode_frame(GET) + struct.pack(">I", (1 << 16) + 1) + b"abc") == [GET]
    assert dec.fatal is not None and dec.fatal.fatal
    with pytest.raises(ProtocolError) as ei:
        dec.feed(encode_frame(GET))
    assert ei.value is dec.fatal


def test_default_cap():
    assert FrameDecoder().max_frame_bytes == DEFAULT_MAX_FRAME_BYTES == 1 << 20


def test_encode_frame_refuses_a_body_over_the_cap():
    with pytest.raises(ProtocolError):
        encode_frame({"id": 1, "op": "ping", "pad": "x" * 5000}, max_frame_bytes=4096)


@pytest.mark.parametrize(
    "body, words",
    [
        (msgpack.packb([1, 2, 3]), "map"),
        (msgpack.packb(42), "map"),
        (msgpack.packb("op"), "map"),
        (msgpack.packb(None), "map"),
        (b"\xc1", "undecodable"),  # never-used msgpack type byte
        (msgpack.packb({"id": 1}) + b"\x00", "undecodable"),  # trailing bytes in the frame
        (msgpack.packb({"id": 1, "op": "get", "key": "k"})[:-1], "undecodable"),  # truncated body
        (b"", "undecodable"),
        (msgpack.packb({1: "int key"}), "undecodable"),
        (msgpack.packb({"id": 1, "blob": b"\x00" * 8}, use_bin_type=True), "undecodable"),  # binary blob
        (b"\x81\xa2\xff\xfe\x01", "undecodable"),  # invalid UTF-8 in a key
        (msgpack.packb({"a": list(range(70000))}), "undecodable"),  # array past the bound
        (b"\x91" * 5000, "undecodable"),  # nesting deeper than the unpacker's stack
    ],
    ids=["list", "int", "str", "nil", "reserved-byte", "extra-data", "truncated", "empty", "int-key",
         "bin", "bad-utf8", "huge-array", "deep-nesting"],
)
def test_bad_body_is_a_nonfatal_error_and_decoding_continues(body, words):
    dec = FrameDecoder()
    out = dec.feed(frame(body) + encode_frame(GET))
    assert len(out) == 2
    err, nxt = out
    assert isinstance(err, ProtocolError)
    assert not err.fatal
    assert words in str(err)
    assert nxt == GET
    assert dec.pending_bytes == 0


def test_bad_body_between_good_frames_fed_in_pieces():
    data = encode_frame(GET) + frame(msgpack.packb([1])) + encode_frame(RESERVE)
    dec = FrameDecoder()
    out = []
    for i in range(0, len(data), 5):
        out += dec.feed(data[i:i + 5])
    assert out[0] == GET and isinstance(out[1], ProtocolError) and out[2] == RESERVE


# ================================================================================== schemas


def test_every_op_parses_with_its_required_arguments():
    examples = {
        "hello": {"version": 1},
        "ping": {},
        "reserve": {"key": "k", "dtype": "float32", "shape": [3, 4]},
        "commit": {"lease": 5},
        "abort": {"lease": 5},
        "bye": {},
        "get": {"key": "k"},
        "prefetch": {"keys": ["a", "b"]},
        "release": {"lease": 5},
        "contains": {"key": "k"},
        "delete": {"key": "k"},
        "stats": {},
    }
    assert set(examples) == set(OPS)
    for op, args in examples.items():
        req = parse_request({"id": 3, "op": op, **args})
        assert isinstance(req, Request)
        assert (req.id, req.op) == (3, op)
        assert set(req.args) == set(args)


def test_every_op_has_a_handler_taking_exactly_its_schema_arguments():
    """The daemon calls ``HANDLERS[op](server, conn, **args)`` with the arguments the schema
    let through: a missing handler, or one without a parameter the schema allows (or with a
    required one it does not require), would answer a valid request with an error."""
    import inspect

    from ectier.daemon.handlers import HANDLERS

    assert set(HANDLERS) == set(OPS)
    for op, schema in OPS.items():
        params = list(inspect.signature(HANDLERS[op]).parameters.values())[2:]  # after (server, conn)
        assert {p.name for p in params} == set(schema), op
        required = {p.name for p in params if p.default is inspect.Parameter.empty}
        assert required == {name for name, (_, req) in schema.items() if req}, op


def test_optional_arguments_and_reserve_shape_becomes_a_tuple():
    req = parse_request({**RESERVE, "namespace": "ns"})
    assert req.args == {"key": "k", "dtype": "bfloat16", "shape": (2040, 8192), "namespace": "ns"}
    assert parse_request({"id": 1, "op": "hello", "version": 1, "client": "vllm"}).args["client"] == "vllm"
    assert parse_request({**RESERVE, "direct": True}).args["direct"] is True
    assert parse_request({"id": 1, "op": "prefetch", "keys": [], "direct": False}).args == {"keys": [], "direct": False}
    # zero-size and 0-d shapes are legal
    assert parse_request({**RESERVE, "shape": [0, 8192]}).args["shape"] == (0, 8192)
    assert parse_request({**RESERVE, "shape": []}).args["shape"] == ()


def _schema_error(msg) -> str:
    with pytest.raises(ProtocolError) as ei:
        parse_request(msg)
    assert not ei.value.fatal
    return str(ei.value)


@pytest.mark.parametrize(
    "msg, field",
    [
        ({"op": "ping"}, "'id'"),
        ({"id": "1", "op": "ping"}, "'id'"),
        ({"id": True, "op": "ping"}, "'id'"),
        ({"id": 1.0, "op": "ping"}, "'id'"),
        ({"id": 1}, "'op'"),
        ({"id": 1, "op": "explode"}, "'op'"),
        ({"id": 1, "op": 7}, "'op'"),
        ({"id": 1, "op": "get"}, "'key'"),
        ({"id": 1, "op": "reserve", "key": "k", "dtype": "float32"}, "'shape'"),
        ({"id": 1, "op": "reserve", "key": "k", "shape": [1]}, "'dtype'"),
        ({"id": 1, "op": "commit"}, "'lease'"),
        ({"id": 1, "op": "hello"}, "'version'"),
        ({"id": 1, "op": "get", "key": 5}, "'key'"),
        ({"id": 1, "op": "get", "key": "k", "namespace": 5}, "'namespace'"),
        ({"id": 1, "op": "get", "key": "k", "namespace": None}, "'namespace'"),
        ({"id": 1, "op": "get", "key": ["k"]}, "'key'"),
        ({"id": 1, "op": "commit", "lease": "5"}, "'lease'"),
        ({"id": 1, "op": "commit", "lease": 5.0}, "'lease'"),
        ({"id": 1, "op": "commit", "lease": True}, "'lease'"),  # bool is not an int here
        ({"id": 1, "op": "release", "lease": False}, "'lease'"),
        ({"id": 1, "op": "hello", "version": True}, "'version'"),
        ({"id": 1, "op": "commit", "lease": -1}, "'lease'"),
        ({"id": 1, "op": "commit", "lease": 1 << 63}, "'lease'"),
        ({"id": 1, "op": "abort", "lease": 1 << 64}, "'lease'"),
        ({**RESERVE, "dtype": "float128"}, "'dtype'"),
        ({**RESERVE, "dtype": "BFloat16"}, "'dtype'"),
        ({**RESERVE, "dtype": "torch.bfloat16"}, "'dtype'"),
        ({**RESERVE, "shape": "2040x8192"}, "'shape'"),
        ({**RESERVE, "shape": [2040, -1]}, "'shape'"),
        ({**RESERVE, "shape": [2040, 1.5]}, "'shape'"),
        ({**RESERVE, "shape": [True, 8192]}, "'shape'"),
        ({**RESERVE, "shape": [1 << 48]}, "'shape'"),
        ({**RESERVE, "shape": [1] * 33}, "'shape'"),
        ({**RESERVE, "shape": [[1]]}, "'shape'"),
        ({"id": 1, "op": "ping", "extra": 1}, "'extra'"),
        ({"id": 1, "op": "get", "key": "k", "lease": 3}, "'lease'"),
        ({"id": 1, "op": "get", "key": "k", "direct": 1}, "'direct'"),  # a bool, not an int
        ({"id": 1, "op": "prefetch"}, "'keys'"),
        ({"id": 1, "op": "prefetch", "keys": "k"}, "'keys'"),
        ({"id": 1, "op": "prefetch", "keys": ["k", 5]}, "'keys'"),
        ({"id": 1, "op": "prefetch", "keys": ["k"] * 1025}, "'keys'"),
        ({"id": 1, "op": "prefetch", "keys": ["k"], "direct": "yes"}, "'direct'"),
    ],
)
def test_schema_errors_name_the_field(msg, field):
    assert field in _schema_error(msg)


def test_unknown_op_lists_the_known_ones():
    text = _schema_error({"id": 1, "op": "explode"})
    assert "explode" in text and "reserve" in text


def test_lease_bounds_are_inclusive_exclusive():
    assert parse_request({"id": 1, "op": "commit", "lease": 0}).args["lease"] == 0
    assert parse_request({"id": 1, "op": "commit", "lease": (1 << 63) - 1}).args["lease"] == (1 << 63) - 1


def test_every_supported_dtype_is_accepted():
    from ectier.entry import DTYPE_ITEMSIZE

    for dtype in DTYPE_ITEMSIZE:
        assert parse_request({**RESERVE, "dtype": dtype}).args["dtype"] == dtype
    for dtype in ("bfloat16", "float16", "float32", "int8", "uint8"):
        assert dtype in DTYPE_ITEMSIZE


def test_reply_helpers():
    assert ok_reply(4, found=True) == {"id": 4, "ok": True, "found": True}
    err = error_reply(None, "ProtocolError", "bad")
    assert err == {"id": None, "ok": False, "error": {"type": "ProtocolError", "message": "bad"}}
    # replies are frames like any other
    assert FrameDecoder().feed(encode_frame(err)) == [err]


# =============================================================================== properties


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(data=st.binary(max_size=600), chunks=st.lists(st.integers(1, 64), max_size=40),
       cap=st.sampled_from([4096, 1 << 16, 1 << 20]))
def test_random_bytes_raise_nothing_but_protocol_error(data, chunks, cap):
    dec = FrameDecoder(cap)
    pos = 0
    sizes = chunks + [len(data)]
    for n in sizes:
        piece, pos = data[pos:pos + n], pos + n
        try:
            out = dec.feed(piece)
        except ProtocolError as exc:
            assert exc.fatal  # only a bad length prefix stops the stream
            return
        for m in out:
            assert isinstance(m, (dict, ProtocolError))
            if isinstance(m, ProtocolError):
                assert not m.fatal
            else:
                try:
                    parse_request(m)
                except ProtocolError as exc:
                    assert not exc.fatal
        if pos >= len(data):
            break
    assert dec.pending_bytes <= len(data)


@settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(random=st.binary(min_size=4, max_size=300))
def test_random_bodies_in_valid_frames_never_desynchronise(random):
    """Whatever a body holds, the frame after it decodes (framing survives bad bodies)."""
    dec = FrameDecoder()
    out = dec.feed(frame(random) + encode_frame(GET))
    assert out[-1] == GET
    assert len(out) == 2


_scalars = st.one_of(st.none(), st.booleans(), st.integers(-(1 << 63), (1 << 64) - 1), st.floats(allow_nan=False),
                     st.text(max_size=20))
_values = st.recursive(_scalars, lambda c: st.lists(c, max_size=4) | st.dictionaries(st.text(max_size=8), c, max_size=4),
                       max_leaves=12)


@settings(max_examples=300, deadline=None)
@given(msg=st.dictionaries(st.sampled_from(["id", "op", "key", "namespace", "dtype", "shape", "lease", "version",
                                            "client", "junk"]), _values, max_size=6)
       | st.fixed_dictionaries({"id": st.integers(0, 10), "op": st.sampled_from(sorted(OPS))},
                               optional={"key": _values, "lease": _values, "shape": _values, "dtype": _values}))
def test_parse_request_raises_only_protocol_error(msg):
    try:
        req = parse_request(msg)
    except ProtocolError as exc:
        assert not exc.fatal
        return
    assert req.op in OPS and isinstance(req.id, int) and not isinstance(req.id, bool)
    # what passed the schema is typed as the schema says
    for name, value in req.args.items():
        types, _ = OPS[req.op][name]
        assert not isinstance(value, bool)
        assert isinstance(value, types) or (name == "shape" and isinstance(value, tuple))


@settings(max_examples=80, deadline=None)
@given(msgs=st.lists(st.dictionaries(st.text(max_size=10), _values, max_size=5), min_size=1, max_size=5),
       step=st.integers(1, 17))
def test_any_map_round_trips_through_frames(msgs, step):
    data = b"".join(encode_frame(m) for m in msgs)
    dec = FrameDecoder()
    out = []
    for i in range(0, len(data), step):
        out += dec.feed(data[i:i + step])
    assert out == msgs


def test_a_client_put_of_more_dimensions_than_reserve_takes_is_an_invalid_tensor_error(tmp_path):
    # refused before any request (no daemon needed): it was the daemon's ProtocolError
    import torch

    from ectier.daemon.client import DaemonClient
    from ectier.daemon.protocol import MAX_DIMS
    from ectier.errors import InvalidTensorError

    client = DaemonClient(str(tmp_path / "none.sock"))
    with pytest.raises(InvalidTensorError, match=rf"^tensor: {MAX_DIMS + 1} dimensions; the daemon stores at most {MAX_DIMS}"):
        client.put("k", torch.zeros([1] * (MAX_DIMS + 1)))
    with pytest.raises(ProtocolError, match="at most 32 ints"):
        parse_request({"id": 1, "op": "reserve", "key": "k", "dtype": "float32", "shape": [1] * (MAX_DIMS + 1)})

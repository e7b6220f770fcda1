"""SSE decoding survives arbitrary chunk boundaries."""

from __future__ import annotations

import json

from loadtest.sse import SSEDecoder


def _feed_all(pieces: list[bytes]) -> list[str]:
    dec = SSEDecoder()
    out: list[str] = []
    for p in pieces:
        out.extend(dec.feed(p))
    return out + dec.close()


def test_multibyte_characters_split_at_every_byte() -> None:
    payloads = [json.dumps({"text": t}, ensure_ascii=False) for t in ("日本語", "é", "🙂 ok")]
    stream = "".join(f"data: {p}\n\n" for p in payloads).encode() + b"data: [DONE]\n\n"
    events = _feed_all([stream[i:i + 1] for i in range(len(stream))])
    assert events == payloads + ["[DONE]"]
    assert json.loads(events[0])["text"] == "日本語"


def test_crlf_split_between_cr_and_lf_comments_and_multiline_data() -> None:
    stream = b": ping\r\n\r\ndata: a\r\ndata: b\r\n\r\nevent: x\r\ndata:c\r\n\r\n"
    cut = stream.index(b"\r\n") + 1  # between \r and \n
    assert _feed_all([stream[:cut], stream[cut:]]) == ["a\nb", "c"]


def test_event_without_final_blank_line_is_flushed_on_close() -> None:
    dec = SSEDecoder()
    assert dec.feed(b"data: {\"x\": 1}") == []
    assert dec.close() == ['{"x": 1}']

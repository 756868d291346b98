"""A forwarded request's answer (deployments/gateway/answer.py): passed on to the client unchanged, its status,
first bytes and end kept in a bounded tail, and the usage read from that end once, for the metrics and the key's
limits and usage alike."""
import asyncio
import json
import time

from deployments.gateway import answer as answer_module
from deployments.gateway.answer import TAIL, Answer, usage_of

JSON_HEAD = {"type": "http.response.start", "status": 200, "headers": [(b"content-type", b"application/json")]}
STREAM_HEAD = {"type": "http.response.start", "status": 200, "headers": [(b"content-type", b"text/event-stream")]}


def answer_of(messages) -> Answer:
    """An answer that went to the client through ``Answer``, message by message, as the gateway sends them."""
    sent = []

    async def send(message):
        sent.append(message)

    answer = Answer(send)

    async def run():
        for message in messages:
            await answer(message)

    asyncio.run(run())
    assert sent == list(messages), "the client gets every message as it was"
    return answer


def body(*chunks: bytes, head=JSON_HEAD) -> list[dict]:
    """The messages of an answer sent in these chunks (the last message empty, as the gateway ends one)."""
    return [head, *({"type": "http.response.body", "body": chunk, "more_body": True} for chunk in chunks),
            {"type": "http.response.body", "body": b""}]


# -- the usage object --------------------------------------------------------------------------------------------


def test_the_usage_of_an_answer_is_read_from_its_own_usage_object():
    openai_shape = json.dumps({
        "id": "chatcmpl-1", "choices": [{"message": {"content": 'say "usage": {"prompt_tokens": 999}'}}],
        "usage": {"prompt_tokens": 19, "completion_tokens": 10, "total_tokens": 29,
                  "prompt_tokens_details": {"cached_tokens": 0}, "completion_tokens_details": {"reasoning_tokens": 0}},
    }, indent=1).encode()
    vllm_shape = (b'{"id":"cmpl-1","choices":[{"text":"hi"}],"usage":{"prompt_tokens":3,"total_tokens":19,'
                  b'"completion_tokens":16,"prompt_tokens_details":null},"prompt_logprobs":null}')
    embeddings = b'{"object":"list","data":[{"embedding":[0.1]}],"usage":{"prompt_tokens":8,"total_tokens":8}}'

    assert usage_of(openai_shape) == (19, 10)
    assert usage_of(vllm_shape) == (3, 16)
    assert usage_of(embeddings) == (8, 0)
    assert usage_of(b'{"choices":[]}') == (0, 0)
    assert usage_of(b'{"usage": {"prompt_tokens_details": {"cached_tokens": 1}, "prompt_tokens": 5, '
                    b'"completion_tokens": 2}}') == (5, 2), "counts after an object inside: the object parsed"
    assert usage_of(b'{"usage":{"prompt_tokens":-4,"completion_tokens":"7"}}') == (0, 0), "not counts: not believed"
    assert usage_of(bytearray(vllm_shape)) == (3, 16), "the tail is a bytearray: read as it is, not copied"


def test_counts_past_the_bound_are_not_believed():
    too_many = answer_module.TOKENS_MAX + 1
    assert usage_of(b'{"usage":{"prompt_tokens":%d,"completion_tokens":3}}' % too_many) == (0, 3)
    assert usage_of(b'{"usage":{"prompt_tokens_details":{},"prompt_tokens":%d,"completion_tokens":3}}'
                    % too_many) == (0, 3), "parsed as JSON: the same bound"


def test_the_usage_is_read_from_the_end_of_whole_answers_and_streams_that_ask_for_it():
    whole = (b'{"id":"chatcmpl-1","choices":[{"index":0,"message":{"content":"' + b"w " * 2000 + b'"}}],'
             b'"usage":{"prompt_tokens":12,"total_tokens":40,"completion_tokens":28,"prompt_tokens_details":null},'
             b'"prompt_logprobs":null,"kv_transfer_params":null}')
    usage_event = b'data: {"id":"c","choices":[],"usage":{"prompt_tokens":7,"completion_tokens":3,"total_tokens":10}}\n\n'
    embeddings = b'{"data":[{"embedding":[0.1,0.2]}],"usage":{"prompt_tokens":4,"total_tokens":4}}'

    assert usage_of(whole) == (12, 28)
    assert usage_of(usage_event + b"data: [DONE]\n\n") == (7, 3)
    assert usage_of(embeddings) == (4, 0)
    assert usage_of(b'data: {"choices":[{"delta":{"content":"hi"}}]}\n\ndata: [DONE]\n\n') == (0, 0)
    assert usage_of(b'{"usage": null}') == (0, 0)
    assert answer_of(body(whole)).tokens() == (12, 28)
    assert answer_of(body(usage_event, b"data: [DONE]\n\n", head=STREAM_HEAD)).tokens() == (7, 3), \
        "the usage event, then [DONE] in a chunk of its own"
    assert answer_of(body(embeddings)).tokens() == (4, 0)


# -- the tail ------------------------------------------------------------------------------------------------------


def test_a_usage_cut_between_chunks_is_read_whole_from_the_tail():
    usage_event = b'data: {"id":"c","choices":[],"usage":{"prompt_tokens":7,"completion_tokens":3,"total_tokens":10}}\n\n'
    cut = answer_of(body(usage_event[:60], usage_event[60:], head=STREAM_HEAD))
    in_bytes = answer_of(body(*(usage_event[at:at + 1] for at in range(len(usage_event))), b"data: [DONE]\n\n",
                              head=STREAM_HEAD))

    assert cut.tokens() == (7, 3)
    assert in_bytes.tokens() == (7, 3), "one byte a chunk"


def test_a_whole_answer_longer_than_the_tail_keeps_only_its_end_and_finds_its_usage_there():
    content = b"w " * 20_000  # 40 KB of content before the usage, in 1 KB chunks and in one chunk
    whole = (b'{"id":"chatcmpl-1","choices":[{"index":0,"message":{"content":"' + content + b'"}}],'
             b'"usage":{"prompt_tokens":12,"total_tokens":20012,"completion_tokens":20000}}')
    chunked = answer_of(body(*(whole[at:at + 1024] for at in range(0, len(whole), 1024))))
    in_one = answer_of(body(whole))

    assert chunked.tokens() == (12, 20000) and in_one.tokens() == (12, 20000)
    assert TAIL <= len(chunked.tail) <= 2 * TAIL and chunked.tail == whole[-len(chunked.tail):]
    assert bytes(in_one.tail) == whole[-TAIL:], "a chunk longer than the tail: only its end kept"
    assert not chunked.streamed


def test_a_usage_followed_by_more_than_the_tail_is_still_counted():
    """vLLM writes prompt_logprobs after the usage of a whole answer: on a long prompt they are longer than the
    tail. The usage is kept from the chunk that held it (a key could otherwise pass its tokens limit so)."""
    logprobs = b'"prompt_logprobs":[' + b",".join(b'{"1":{"logprob":-0.5,"rank":1}}' for _ in range(2000)) + b"]}"
    whole = (b'{"id":"chatcmpl-1","choices":[{"index":0,"message":{"content":"hi"}}],'
             b'"usage":{"prompt_tokens":2000,"total_tokens":2001,"completion_tokens":1},' + logprobs)
    assert len(logprobs) > 2 * TAIL

    chunked = answer_of(body(*(whole[at:at + 1024] for at in range(0, len(whole), 1024))))
    in_one = answer_of(body(whole))

    assert chunked.tokens() == (2000, 1) and in_one.tokens() == (2000, 1)


def test_a_stream_counts_its_tokens_from_the_final_usage_chunk_and_none_without_one():
    events = [b'data: {"choices":[{"delta":{"content":"x"}}],"usage":null}\n\n' for _ in range(2000)]
    final = b'data: {"choices":[],"usage":{"prompt_tokens":12,"completion_tokens":2000,"total_tokens":2012}}\n\n'
    with_usage = answer_of(body(*events, final + b"data: [DONE]\n\n", head=STREAM_HEAD))
    without = answer_of([STREAM_HEAD, *({"type": "http.response.body", "body": e, "more_body": True} for e in events),
                         {"type": "http.response.body", "body": b"data: [DONE]\n\n"}])

    assert with_usage.tokens() == (12, 2000)
    assert with_usage.streamed and len(with_usage.tail) <= 2 * TAIL, "a stream keeps only its tail"
    assert without.tokens() == (0, 0)


def test_an_error_answer_counts_no_tokens():
    usage = b'{"usage":{"prompt_tokens":5,"completion_tokens":5}}'
    error = answer_of([{"type": "http.response.start", "status": 500, "headers": []},
                       {"type": "http.response.body", "body": usage}])
    refused = answer_of([{"type": "http.response.start", "status": 400, "headers": []},
                         {"type": "http.response.body", "body": usage}])
    assert error.tokens() == (0, 0) and refused.tokens() == (0, 0)
    assert Answer(None).tokens() == (0, 0), "no answer began (the client left)"


# -- what the metrics read -----------------------------------------------------------------------------------------


def test_the_answer_notes_its_status_its_first_bytes_and_whether_it_streams():
    before = time.perf_counter()
    head_only = answer_of([STREAM_HEAD])
    streamed = answer_of(body(b"data: {}\n\n", head=STREAM_HEAD))
    whole = answer_of(body(b"{}"))

    assert head_only.status == 200 and head_only.first_at is None, "no body bytes yet: no first token"
    assert streamed.streamed and before < streamed.first_at
    assert whole.status == 200 and not whole.streamed and whole.first_at is not None
    assert Answer(None).status is None


def test_the_tokens_are_read_once_however_often_asked(monkeypatch):
    answer = answer_of(body(b'{"usage":{"prompt_tokens":5,"completion_tokens":2}}'))
    reads = []
    monkeypatch.setattr(answer_module, "usage_of", lambda data: reads.append(data) or (5, 2))

    assert answer.tokens() == (5, 2) and answer.tokens() == (5, 2)
    assert len(reads) == 1, "the metrics and the key's usage share one reading"

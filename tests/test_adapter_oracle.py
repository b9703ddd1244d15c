"""kite.data.texts: the in-document adapter's training pairs (benchmarks/adapter_oracle.py) come
from windows of the text after the scored region, each pair's prompt right after its window and its
response right after the prompt."""

from kite.data.texts import window_pairs
from kite.upcycle.study import CONTINUATION, context_tokens


def decode(ids):
    return " ".join(map(str, ids))


def test_windows_every_stride_with_prompts_and_responses_following_them_and_none_past_the_end():
    ids = list(range(1000, 1400))
    out = window_pairs(ids, decode, window_tokens=100, stride=50, pairs=2, prompt_tokens=4, response_tokens=8,
                       name="doc")
    starts = sorted({int(p["id"].split("@")[1].split("/")[0]) for p in out})
    assert starts == list(range(0, 400 - 100 - 2 * 12 + 1, 50))
    for p in out:
        start, i = (int(x) for x in p["id"].split("@")[1].split("/"))
        end = start + 100
        assert p["context"] == decode(ids[start:end])
        assert p["prompt"] == decode(ids[end:end + 4 + i * 12])
        assert p["response"] == decode(ids[end + 4 + i * 12:end + 4 + i * 12 + 8])
    last = max(int(p["response"].split()[-1]) for p in out)
    assert last <= ids[-1]
    assert len(out) == 2 * len(starts)


def test_no_window_when_the_text_is_shorter_than_a_window_and_its_pairs():
    assert window_pairs(list(range(120)), decode, 100, 10, 2, 4, 8, "doc") == []


def test_the_scored_region_is_the_quality_tables_context_and_continuation():
    assert context_tokens(7658) + CONTINUATION == 2048 + 512
    assert context_tokens(1618) + CONTINUATION == 1618

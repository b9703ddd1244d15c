"""kite.data.texts and `kite data pairs --texts`: continuation pairs of real documents, each window
followed by its pairs, texts read from files and folders (gzip too), and windows that quote an
excluded text dropped."""

import gzip
import json
import random

import pytest

from typer.testing import CliRunner

from kite.cli.data import app
from kite.data.jsonl import read_jsonl
from kite.errors import BadInput
from kite.data.texts import MAX_SHARED, ngrams, read_texts, shared, text_pairs

WORDS = ("river stone lantern orchard copper meadow harbor violet signal thunder marble canyon "
         "ember willow falcon granite").split()


def prose(seed: int, n: int) -> str:
    rng = random.Random(seed)
    return " ".join(rng.choice(WORDS) + str(rng.randrange(50)) for _ in range(n))


def tokenize(text: str) -> list[int]:      # a word a token, the word's own text its id's meaning
    return [hash(w) for w in text.split()]


def word_pairs(texts, **kw):
    vocab = {}
    for _, t in texts:
        for w in t.split():
            vocab[hash(w)] = w
    return text_pairs(texts, tokenize, lambda ids: " ".join(vocab[i] for i in ids), **kw)


def test_each_window_is_followed_by_its_pairs_in_the_text():
    text = prose(0, 1000)
    words = text.split()
    got = word_pairs([("doc", text)], window_tokens=100, pairs_per_window=3, prompt_tokens=2, response_tokens=10,
                     windows_per_text=4)
    assert got.windows == 4 and len(got.records) == 12 and got.summary()["pairs"] == 12
    for r in got.records:
        start, i = (int(x) for x in r["id"].split("@")[1].split("/"))
        assert start % (100 + 3 * 12) == 0                   # windows do not overlap
        assert r["context"] == " ".join(words[start:start + 100])
        at = start + 100 + i * 12
        assert r["prompt"] == " ".join(words[start + 100:at + 2])   # the text from the window's end
        assert r["response"] == " ".join(words[at + 2:at + 12])
        assert r["meta"] == {"family": "continuation"}


def test_the_draw_follows_the_seed_and_max_windows_caps_the_whole():
    texts = [(f"t{i}", prose(i, 800)) for i in range(5)]
    kw = dict(window_tokens=100, pairs_per_window=1, prompt_tokens=2, response_tokens=10, windows_per_text=3)
    a, b = word_pairs(texts, seed=1, **kw), word_pairs(texts, seed=1, **kw)
    assert a.records == b.records and a.windows == 15
    assert word_pairs(texts, seed=2, **kw).records != a.records
    capped = word_pairs(texts, seed=1, max_windows=4, **kw)
    assert capped.windows == 4 and {r["id"] for r in capped.records} <= {r["id"] for r in a.records}
    with pytest.raises(BadInput, match="windows in all: 0"):
        word_pairs(texts, max_windows=0, **kw)


def test_a_text_shorter_than_a_window_and_its_pairs_is_counted_not_used():
    got = word_pairs([("short", prose(0, 50)), ("long", prose(1, 400))], window_tokens=100, pairs_per_window=2,
                     prompt_tokens=2, response_tokens=10, windows_per_text=1)
    assert got.too_short == 1 and got.windows == 1 and {r["id"].split("@")[0] for r in got.records} == {"long"}


def test_a_window_quoting_an_excluded_text_is_dropped_and_a_stock_sentence_is_not():
    held = prose(99, 600)
    quoting = prose(5, 200) + " " + " ".join(held.split()[100:300]) + " " + prose(6, 200)
    stock = " ".join(held.split()[:14])          # two runs of 13 words among ~600: under MAX_SHARED
    clean = prose(7, 300) + " " + stock + " " + prose(8, 300)
    kw = dict(window_tokens=400, pairs_per_window=1, prompt_tokens=2, response_tokens=20, windows_per_text=1)
    got = word_pairs([("quoting", quoting), ("clean", clean)], exclude=[held], **kw)
    assert got.excluded == 1 and {r["id"].split("@")[0] for r in got.records} == {"clean"}
    assert 0 < shared(ngrams(clean), ngrams(held)) <= MAX_SHARED
    assert word_pairs([("quoting", quoting)], **kw).windows == 1       # nothing excluded: kept


def test_texts_are_read_from_files_and_folders_gzip_too_each_text_once(tmp_path):
    (tmp_path / "a.txt").write_text(prose(0, 600))
    (tmp_path / "sub").mkdir()
    (tmp_path / "sub" / "b.gz").write_bytes(gzip.compress(prose(1, 600).encode()))
    (tmp_path / "sub" / "copy.txt").write_text(prose(0, 600))           # the same text again
    (tmp_path / "sub" / "tiny.txt").write_text("too short")
    (tmp_path / "sub" / "blob.bin").write_bytes(bytes(range(256)) * 20)
    (tmp_path / "sub" / "broken.gz").write_bytes(b"\x1f\x8b not gzip" * 300)
    seen = []
    names = [n for n, _ in read_texts([tmp_path], progress=lambda *a: seen.append(a))]
    assert names == [str(tmp_path / "a.txt"), str(tmp_path / "sub" / "b.gz")]
    assert seen == [("texts", i, 6) for i in range(1, 7)]       # every file, read or skipped
    assert list(read_texts([tmp_path / "a.txt"]))[0][1] == prose(0, 600)
    with pytest.raises(BadInput, match="nope: no such file"):
        read_texts([tmp_path / "a.txt", tmp_path / "nope"])


def test_cli_writes_continuation_pairs_beside_contract_pairs_and_says_what_it_left_out(tmp_path, tiny_models):
    texts = tmp_path / "texts"
    texts.mkdir()
    for i in range(3):
        (texts / f"t{i}.txt").write_text(prose(i, 1500))
    held = tmp_path / "held.txt"
    held.write_text((texts / "t2.txt").read_text())
    out = tmp_path / "pairs.jsonl"
    args = ["pairs", "--texts", str(texts), "--exclude", str(held), "--window-tokens", "300", "--pairs-per-window",
            "2", "--response-tokens", "40", "--model", str(tiny_models["llama"]), "--out", str(out)]
    res = CliRunner().invoke(app, [*args, "--json"])
    assert res.exit_code == 0, res.output
    s = json.loads(res.stdout)
    assert "texts 3/3" in res.stderr                 # progress on stderr, a file at a time
    assert s["contracts"] == 0 and s["pairs_per_family"] == {"continuation": 8}
    assert s["texts"] == {"texts": 3, "too_short": 0, "windows": 4, "excluded_windows": 2, "pairs": 8}
    recs = read_jsonl(out)
    assert {r["id"].split("@")[0] for r in recs} == {str(texts / "t0.txt"), str(texts / "t1.txt")}

    res = CliRunner().invoke(app, [*args, "--n", "1"])
    assert res.exit_code == 0, res.output
    assert "texts: 4 windows of 3 texts, 0 too short, 2 windows excluded" in res.output
    assert {r["meta"]["family"] for r in read_jsonl(out)} >= {"continuation", "qa"}


def test_cli_refuses_bad_texts_in_one_line(tmp_path, tiny_models):
    runner = CliRunner()
    res = runner.invoke(app, ["pairs", "--texts", str(tmp_path / "nope"), "--out", str(tmp_path / "p.jsonl")])
    assert res.exit_code == 2 and "--texts" in res.output and "no such file" in res.output
    (tmp_path / "short.txt").write_text(prose(0, 300))        # read (over 2,000 characters), under one window
    res = runner.invoke(app, ["pairs", "--texts", str(tmp_path / "short.txt"), "--model", str(tiny_models["llama"]),
                              "--out", str(tmp_path / "p.jsonl")])
    assert res.exit_code == 2 and "no window of 2048 tokens" in res.output
    res = runner.invoke(app, ["pairs", "--texts", str(tmp_path), "--windows-per-text", "0",
                              "--model", str(tiny_models["llama"]), "--out", str(tmp_path / "p.jsonl")])
    assert res.exit_code == 2 and "windows a text: 0" in res.output
    res = runner.invoke(app, ["pairs", "--n", "0", "--out", str(tmp_path / "p.jsonl")])
    assert res.exit_code == 2 and "--n 0" in res.output
    res = runner.invoke(app, ["pairs", "--n", "-1", "--texts", str(tmp_path), "--out", str(tmp_path / "p.jsonl")])
    assert res.exit_code == 2 and "--n -1: need at least 0 contracts" in res.output
    assert not (tmp_path / "p.jsonl").exists()

"""Issue 31, the data readers' failures and weak spots: what a data path is (a directory, a
device, a FIFO, a link loop), compressed files, keys given twice, JSON messages, the TSV
hint, --eval-data equal to --data, one-row correlations, long rows clipped before they are
tokenised (against the plain tokenizer call), and record messages that name CLI flags.

Each test's docstring says what today's code did (the test fails on it)."""

from __future__ import annotations

import gzip
import json
import os
import random
import threading
from pathlib import Path

import pytest

from zenflow.errors import DataError
from zenflow.train.data import (
    Encoded,
    Example,
    GlueTask,
    build_sft,
    compute_metrics,
    is_truncated,
    load_lm_data,
    load_table_task,
    metrics_for,
    pearson,
    read_records,
    read_rows,
    records_from,
    spearman,
)
from zenflow.train.data.encoding import clip_text
from zenflow.train.models import packaged_gpt2_tokenizer

ROWS = [{"text": f"row {i} is {'good' if i % 2 else 'bad'}", "label": i % 2} for i in range(20)]


def _jsonl(path: Path, rows=ROWS) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows), encoding="utf-8")
    return path


@pytest.fixture(scope="module")
def tok():
    t = packaged_gpt2_tokenizer()
    t.pad_token = t.eos_token
    return t


def _both_readers(path):
    """The table reader and the record reader on ``path``: (table error, record error)."""
    errors = []
    for read in (lambda: read_rows(path, ["text"], "label"), lambda: read_records(path)):
        with pytest.raises(DataError) as e:
            read()
        errors.append(str(e.value))
    return errors


# ------------------------------------------------------------------ what the path is


def test_a_directory_is_said_to_be_one_with_its_data_files(tmp_path):
    """Old: "unknown table format '(no suffix)'" (no suffix) or "Is a directory" (.jsonl)."""
    folder = tmp_path / "mydata"
    folder.mkdir()
    _jsonl(folder / "train.jsonl")
    for msg in _both_readers(folder):
        assert f"{folder} is a directory, not a data file; it holds train.jsonl" in msg
        assert "unknown" not in msg


def test_a_device_is_said_to_be_one():
    """Old: /dev/null was "unknown table format '(no suffix)'"."""
    for msg in _both_readers(Path("/dev/null")):
        assert "/dev/null is a character device, not a data file. Pass a file (.json" in msg
        assert "unknown" not in msg


def test_a_fifo_is_refused_before_it_is_opened(tmp_path):
    """Old: read once here (a second read, the sha256 or the trainer's, hung forever). The
    writer writes once, so the old code returned rows instead of hanging this test."""
    fifo = tmp_path / "stream.jsonl"
    os.mkfifo(fifo)
    payload = "".join(json.dumps(r) + "\n" for r in ROWS).encode()

    def write_once():
        with open(fifo, "wb") as f:  # blocks until a reader opens the FIFO
            f.write(payload)

    writer = threading.Thread(target=write_once, daemon=True)
    writer.start()
    try:
        msgs = _both_readers(fifo)
    finally:  # release the writer: open the read end and drain it
        fd = os.open(fifo, os.O_RDONLY | os.O_NONBLOCK)
        writer.join(timeout=30)
        os.close(fd)
    for msg in msgs:
        assert f"{fifo} is a FIFO (named pipe), not a regular file" in msg
        assert "more than once" in msg and f"cat {fifo} > data.jsonl" in msg


def test_a_symlink_loop_is_named(tmp_path):
    """Old (the reader): "Cannot read ...: Too many levels of symbolic links" without the
    cause; the CLI's resolve() raised RuntimeError (tests/cli/test_hostile_inputs.py)."""
    a, b = tmp_path / "a.jsonl", tmp_path / "b.jsonl"
    a.symlink_to(b)
    b.symlink_to(a)
    for msg in _both_readers(a):
        assert f"{a} is a symbolic link loop" in msg


@pytest.mark.parametrize("suffix", [".jsonl", ".json", ".csv"])
def test_a_gzip_file_under_a_text_suffix_is_said_to_be_gzip(tmp_path, suffix):
    """Old: "not UTF-8 text ... re-encode the file (e.g. iconv -f latin1 ...)"."""
    path = tmp_path / f"train{suffix}"
    path.write_bytes(gzip.compress(b'{"text": "a", "label": 1}\n' * 50))
    with pytest.raises(DataError) as e:
        read_rows(path, ["text"], "label")
    msg = str(e.value)
    assert f"{path} is gzip-compressed, not UTF-8 text" in msg and "gunzip -k" in msg
    assert "iconv" not in msg


# ------------------------------------------------------------------ JSON


def test_a_key_given_twice_is_refused_with_its_line(tmp_path):
    """Old: read silently, the last value kept."""
    lines = ['{"text": "fine", "label": 1}', '{"text": "lost", "label": 0, "text": "kept"}']
    path = tmp_path / "d.jsonl"
    path.write_text("\n".join(lines) + "\n", encoding="utf-8")
    for msg in _both_readers(path):
        assert f"{path}, line 2: the key 'text' appears twice in one object" in msg


def test_a_key_given_twice_in_a_json_array_names_its_item_and_line(tmp_path):
    """Old: read silently. A nested object (a chat message) is checked too."""
    path = tmp_path / "d.json"
    path.write_text('[\n{"text": "a", "label": 1},\n{"label": 0, "text": "b", "label": 1}\n]',
                    encoding="utf-8")  # fmt: skip
    with pytest.raises(DataError, match=r"d\.json, item 2 of the array \(line 3\): the key "
                       "'label' appears twice"):  # fmt: skip
        read_rows(path, ["text"], "label")
    chat = tmp_path / "c.json"
    chat.write_text('[{"messages": [{"role": "user", "content": "a", "role": "assistant"}]}]',
                    encoding="utf-8")  # fmt: skip
    with pytest.raises(DataError, match=r"item 1 of the array \(line 1\): the key 'role'"):
        read_records(chat)


def test_a_json_error_reads_once_at_its_column(tmp_path):
    """Old: "(Unterminated string starting at at column 10)"."""
    path = tmp_path / "d.jsonl"
    path.write_text('{"text": "a", "label": 1}\n{"text": "b\n', encoding="utf-8")
    for msg in _both_readers(path):
        assert f"{path}, line 2: not valid JSON (Unterminated string, column 10)" in msg
        assert "at at" not in msg


def test_tsv_width_hint_never_suggests_the_quoting_already_set(tmp_path):
    """Old: with --tsv-quoting none it still said "need --tsv-quoting none"."""
    path = tmp_path / "d.tsv"
    path.write_text("text\tlabel\na\t1\nb\tc\t0\n", encoding="utf-8")
    with pytest.raises(DataError) as e:
        read_rows(path, ["text"], "label", tsv_quoting="none")
    assert "With --tsv-quoting none every tab separates columns" in str(e.value)
    assert "need --tsv-quoting none" not in str(e.value)
    with pytest.raises(DataError, match="GLUE-style TSV files need --tsv-quoting none"):
        read_rows(path, ["text"], "label")


# ------------------------------------------------------------------ --eval-data == --data


def test_eval_data_equal_to_data_is_warned_in_the_header(tmp_path, tok):
    """Old: no word of it; the eval figures were the training rows' fit."""
    path = _jsonl(tmp_path / "d.jsonl")
    twin = tmp_path / "twin.jsonl"
    os.link(path, twin)  # another name for the same file
    for eval_path in (path, twin):
        _, report = load_table_task(path, eval_path, text_fields=["text"])
        assert any("--eval-data is the same file as --data" in ln for ln in report.lines())
    other = _jsonl(tmp_path / "other.jsonl", ROWS[:10])
    _, report = load_table_task(path, other, text_fields=["text"])
    assert not any("same file" in ln for ln in report.lines())
    lm = _jsonl(tmp_path / "lm.jsonl", [{"text": r["text"]} for r in ROWS])
    lines = load_lm_data(lm, lm, tok, 16).header_lines()
    assert any("--eval-data is the same file as --data" in ln for ln in lines)


# ------------------------------------------------------------------ metrics


def test_a_correlation_of_one_pair_is_null_not_zero():
    """Old: 0.0 for pearson and spearman of one row (undefined, reported as no correlation)."""
    assert pearson([0.3], [0.7]) is None and spearman([0.3], [0.7]) is None
    task = GlueTask(name="r", text_columns=("text",), label_column="label", num_labels=1,
                    metrics=metrics_for(1), hub_config="", hub_text_columns=("text",))  # fmt: skip
    assert compute_metrics(task, [0.3], [0.7]) == {"pearson": None, "spearman": None}
    got = compute_metrics(task, [0.1, 0.2, 0.4], [1.0, 2.0, 3.0])
    assert got["pearson"] == pytest.approx(0.9819805) and got["spearman"] == 1.0


# ------------------------------------------------------------------ long rows


def _long_texts():
    rng = random.Random(0)
    words = "the a film moving dull joy naïve 東京 🙂 ----- \n\n 12345".split(" ")
    return {
        "words": " ".join(rng.choice(words) for _ in range(60_000)),
        "one word": "ab" * 60_000,
        "digits": "".join(rng.choice("0123456789") for _ in range(90_000)),
        "spaces": " " * 100_000 + "hello world " * 10,
    }


class SpyTokenizer:
    """The tokenizer, recording the longest text it is given."""

    def __init__(self, tok):
        self.tok, self.longest = tok, 0

    def __call__(self, text, *args, **kwargs):
        for t in [text, *args[:1]]:
            for one in [t] if isinstance(t, str) else t or []:
                self.longest = max(self.longest, len(one))
        return self.tok(text, *args, **kwargs)

    def __getattr__(self, name):
        return getattr(self.tok, name)


@pytest.mark.parametrize("seq_len", [16, 128])
def test_long_rows_are_clipped_before_tokenising_with_the_same_tokens(tok, seq_len):
    """Old: every row was tokenised whole before truncation (a 30 MB row took 4.8 GB; see
    docs/BENCHMARKS.md). Reference: the plain tokenizer call on the whole texts."""
    texts = _long_texts()
    spy = SpyTokenizer(tok)
    rows = [Example((t,), 1) for t in texts.values()]
    got = Encoded(rows, spy, seq_len, False).tensors()["input_ids"].tolist()
    want = tok(list(texts.values()), truncation=True, max_length=seq_len,
               padding="max_length")["input_ids"]  # fmt: skip
    assert got == want
    assert spy.longest < min(map(len, texts.values()))  # never the whole of a long row
    pairs = [Example((t, "a short second text"), 1) for t in texts.values()]
    got = Encoded(pairs, tok, seq_len, False).tensors()["input_ids"].tolist()
    want = tok(list(texts.values()), ["a short second text"] * 4, truncation=True,
               max_length=seq_len, padding="max_length")["input_ids"]  # fmt: skip
    assert got == want
    assert is_truncated(rows, tok, seq_len) == [True] * 4
    for t in texts.values():  # a short text is never clipped
        assert clip_text(t[:50], tok, seq_len) == t[:50]


def test_long_records_are_clipped_with_the_same_ids_and_counts(tok):
    """Old: each record was tokenised whole. Reference: the whole text's ids, truncated."""
    texts = list(_long_texts().values())
    spy = SpyTokenizer(tok)
    data, report = build_sft(records_from([{"text": t} for t in texts]), spy, 32)
    want = [tok(t, add_special_tokens=False)["input_ids"][:32] for t in texts]
    assert [data.take([i])["input_ids"][0].tolist() for i in range(4)] == want
    assert report.counts.truncated == 4 and spy.longest < min(map(len, texts))
    pc = records_from(
        [{"prompt": texts[0], "completion": " yes"}, {"prompt": "q", "completion": " no"}]
    )
    _, report = build_sft(pc, tok, 32)
    assert report.counts.kept == 1 and report.counts.truncated == 1
    assert report.counts.dropped == {"with no completion tokens left after truncation at 32": 1}


# ------------------------------------------------------------------ record messages


def test_record_messages_name_the_cli_flags(tmp_path, tok):
    """Old: "name it with the completion_field setting", "field names can be set with
    text_field, ...", "Raise seq_len" for records dropped as empty."""
    path = tmp_path / "r.jsonl"
    path.write_text('{"prompt": "q"}\n', encoding="utf-8")
    with pytest.raises(DataError, match="name the file's field with --completion-field"):
        read_records(path)
    path.write_text('{"question": "q"}\n', encoding="utf-8")
    with pytest.raises(DataError, match="--text-field, --prompt-field, --completion-field"):
        read_records(path)
    with pytest.raises(DataError) as e:
        build_sft(records_from([{"text": " "}, {"text": ""}]), tok, 16)
    assert "Fix: fill in the empty fields." in str(e.value) and "seq" not in str(e.value)


def test_a_chat_template_without_assistant_turns_is_named(tok):
    """Old: every record dropped "with no assistant tokens", and the fixes were "Raise
    seq_len, shorten the prompts, or fill in the empty fields"."""
    tok = packaged_gpt2_tokenizer()
    tok.chat_template = (
        "{% for m in messages %}{% if m['role'] == 'user' %}User: {{ m['content'] }}\n"
        "{% endif %}{% endfor %}"
    )
    chat = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "hello"}]
    with pytest.raises(DataError) as e:
        build_sft(records_from([{"messages": chat}] * 3), tok, 64)
    assert "chat template renders nothing for the assistant's turn (message 2)" in str(e.value)
    assert "prompt/completion" in str(e.value) and "seq_len" not in str(e.value)

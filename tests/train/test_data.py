from __future__ import annotations

import pytest
import torch

from moc.train.data import BatchSampler, Corpus, load_corpus, stdlib_sources, windows


def test_default_corpus_is_the_stdlib_without_site_packages():
    files = stdlib_sources()
    assert len(files) > 500
    assert not any("site-packages" in f.parts for f in files)
    assert all(f.suffix == ".py" for f in files)


def test_split_is_deterministic_and_disjoint(tmp_path):
    (tmp_path / "a.txt").write_text("hello world " * 500)
    a, b = Corpus.load(tmp_path, 16), Corpus.load(tmp_path, 16)
    assert (a.train == b.train).all() and (a.val == b.val).all()
    assert len(a.train) + len(a.val) == len(load_corpus(tmp_path))


def test_sampler_resumes_exactly_from_its_state():
    straight = BatchSampler(n_tokens=10_000, seq_len=16, global_batch=8, seed=3)
    batches = [straight.next() for _ in range(200)]  # crosses several epochs
    resumed = BatchSampler(n_tokens=10_000, seq_len=16, global_batch=8, seed=3)
    for _ in range(77):
        resumed.next()
    state = resumed.state_dict()
    fresh = BatchSampler(n_tokens=10_000, seq_len=16, global_batch=8, seed=3)
    fresh.load_state_dict(state)
    for want in batches[77:]:
        assert torch.equal(fresh.next(), want)


def test_windows_are_next_byte_targets():
    data = torch.arange(100, dtype=torch.uint8).numpy()
    x, y = windows(data, torch.tensor([0, 10]), 4)
    assert x.tolist() == [[0, 1, 2, 3], [10, 11, 12, 13]]
    assert y.tolist() == [[1, 2, 3, 4], [11, 12, 13, 14]]


def test_bad_data_paths_get_clear_errors(tmp_path):
    with pytest.raises(ValueError, match="no such file or directory"):
        load_corpus(tmp_path / "missing")
    (tmp_path / "empty").mkdir()
    with pytest.raises(ValueError, match="holds no files"):
        load_corpus(tmp_path / "empty")
    (tmp_path / "zero.txt").write_text("")
    with pytest.raises(ValueError, match="empty"):
        load_corpus(tmp_path / "zero.txt")
    (tmp_path / "short.txt").write_text("abc")
    with pytest.raises(ValueError, match="too small"):
        Corpus.load(tmp_path / "short.txt", 16)

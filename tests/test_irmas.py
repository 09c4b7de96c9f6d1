"""datasets.irmas on small wav trees that the tests write themselves."""

from __future__ import annotations

from pathlib import Path

import librosa
import numpy as np
import pytest
import soundfile
import torch
from helpers import stereo_clip, write_tree

from datasets import irmas
from datasets.irmas import CLASSES, SETTINGS, IRMASError, extract

RATE = irmas.SAMPLE_RATE


@pytest.fixture(scope="module")
def tree(tmp_path_factory) -> Path:
    return write_tree(tmp_path_factory.mktemp("irmas") / "IRMAS-TrainingData")


@pytest.fixture(scope="module")
def small(tree: Path, tmp_path_factory) -> irmas.IRMASFeatures:
    return extract(tree, "s", tmp_path_factory.mktemp("cache"), workers=1, progress=False)


def test_shapes_labels_and_reported_misfits(small: irmas.IRMASFeatures) -> None:
    n = 11 * 2 + 2  # the resampled and the padded clip are kept
    assert small.features.shape == (n, SETTINGS["s"].frames, SETTINGS["s"].features) == (n, 259, 38)
    assert small.features.dtype == torch.float32
    for rel, label in zip(small.files, small.labels.tolist(), strict=True):
        assert rel.split("/")[0] == CLASSES[label]
    assert small.skipped == {"unreadable": ["gac/corrupt.wav"], "not stereo": ["cel/mono.wav"]}
    assert small.fixed == {"resampled": 1, "length adjusted": 1}
    assert small.per_class()["cla"] == 3 and small.per_class()["gac"] == 2


def test_every_coefficient_is_standardized_over_time(small: irmas.IRMASFeatures) -> None:
    mean = small.features.mean(dim=1)
    std = small.features.std(dim=1, unbiased=False)
    assert mean.abs().max() < 1e-4
    assert (std - 1).abs().max() < 1e-3


@pytest.mark.parametrize("frames", ["m", "l"])
def test_one_clip_matches_a_direct_librosa_computation(tree: Path, tmp_path: Path, frames: str) -> None:
    data = extract(tree, frames, tmp_path, workers=1, progress=False)
    row = data.files.index("vio/vio1.wav")
    audio, _ = soundfile.read(tree / "vio" / "vio1.wav", dtype="float32")
    st = SETTINGS[frames]
    parts = []
    for channel in (0, 1):
        c = librosa.feature.mfcc(
            y=audio[:, channel], sr=RATE, n_mfcc=st.n_mfcc, n_fft=st.n_fft, hop_length=st.hop
        )[1:]
        parts.append((c - c.mean(1, keepdims=True)) / c.std(1, keepdims=True))
    expected = torch.from_numpy(np.concatenate(parts).T.astype(np.float32))
    assert data.features[row].shape == expected.shape == (st.frames, st.features)
    assert torch.allclose(data.features[row], expected, atol=1e-4)


def test_second_load_reads_the_cache(tree: Path, tmp_path: Path, monkeypatch) -> None:
    first = extract(tree, "s", tmp_path, workers=1, progress=False)
    assert not first.from_cache
    monkeypatch.setattr(irmas, "load_clip", lambda *a, **k: pytest.fail("extracted again"))
    second = extract(tree, "s", tmp_path, workers=1, progress=False)
    assert second.from_cache and second.cache_path == first.cache_path
    assert torch.equal(first.features, second.features) and second.skipped == first.skipped


def test_a_changed_tree_or_setting_recomputes(tmp_path: Path) -> None:
    root = tmp_path / "tree"
    for name in CLASSES[:2]:
        (root / name).mkdir(parents=True)
        soundfile.write(root / name / "a.wav", stereo_clip(1), RATE)
    cache = tmp_path / "cache"
    first = extract(root, "l", cache, workers=1, progress=False)
    soundfile.write(root / "cel" / "b.wav", stereo_clip(2), RATE)
    grown = extract(root, "l", cache, workers=1, progress=False)
    assert not grown.from_cache and grown.cache_path != first.cache_path
    assert grown.features.shape[0] == first.features.shape[0] + 1
    other = extract(root, "m", cache, workers=1, progress=False)
    assert not other.from_cache and other.features.shape[1:] == (517, 24)


def test_a_killed_write_leaves_no_cache_that_reads_as_complete(tmp_path: Path, monkeypatch) -> None:
    root = tmp_path / "tree"
    (root / "pia").mkdir(parents=True)
    soundfile.write(root / "pia" / "a.wav", stereo_clip(3), RATE)

    def die_half_way(obj, f, *args, **kwargs):
        Path(f).write_bytes(b"half a pickle")
        raise KeyboardInterrupt

    monkeypatch.setattr(torch, "save", die_half_way)
    with pytest.raises(KeyboardInterrupt):
        extract(root, "l", tmp_path / "cache", workers=1, progress=False)
    assert list((tmp_path / "cache").iterdir()) == []
    monkeypatch.undo()
    data = extract(root, "l", tmp_path / "cache", workers=1, progress=False)
    assert not data.from_cache and data.features.shape[0] == 1


def test_worker_processes_give_the_same_features(tree: Path, tmp_path: Path, small) -> None:
    pooled = extract(tree, "s", tmp_path, workers=2, progress=False)
    assert pooled.files == small.files
    assert torch.equal(pooled.features, small.features)


def test_loaders_split_and_batch(tree: Path, tmp_path: Path) -> None:
    train, test = irmas.irmas_loaders(tree, "s", batch_size=4, cache_dir=tmp_path, workers=1)
    assert len(train.dataset) + len(test.dataset) == 24 and len(test.dataset) == 5
    x, y = next(iter(train))
    assert x.shape == (4, 259, 38) and y.dtype == torch.int64


@pytest.mark.parametrize(
    ("make", "message"),
    [
        (lambda p: p / "missing", "does not exist or is not a folder; expected the IRMAS training data"),
        (lambda p: p, "holds no class folder with .wav clips"),
        (lambda p: (p / "cel").mkdir() or p, "holds no class folder with .wav clips"),
    ],
)
def test_missing_or_empty_roots_say_what_and_where(tmp_path: Path, make, message: str) -> None:
    with pytest.raises(IRMASError, match=message) as exc:
        extract(make(tmp_path), "s", tmp_path / "cache", workers=1)
    assert "https://www.upf.edu/web/mtg/irmas" in str(exc.value) and "\n" not in str(exc.value)


def test_a_tree_of_misfits_only_fails_clearly(tmp_path: Path) -> None:
    (tmp_path / "org").mkdir()
    soundfile.write(tmp_path / "org" / "mono.wav", stereo_clip(5)[:, 0], RATE)
    (tmp_path / "org" / "bad.wav").write_bytes(b"junk")
    with pytest.raises(IRMASError, match=r"no usable clips under .* \(1 unreadable, 1 not stereo\)"):
        extract(tmp_path, "s", tmp_path / "cache", workers=1, progress=False)


def test_bad_options_are_named(tree: Path) -> None:
    with pytest.raises(IRMASError, match="unknown IRMAS frames setting 'xl'; accepted: s, m, l"):
        extract(tree, "xl")
    with pytest.raises(IRMASError, match="batch_size must be a positive integer, got 0"):
        irmas.irmas_loaders(tree, "s", batch_size=0)


def test_cli_reports_the_cache_and_fails_in_one_line(tree: Path, tmp_path: Path, capsys) -> None:
    argv = ["--root", str(tree), "--frames", "s", "--cache-dir", str(tmp_path), "--workers", "1"]
    assert irmas.main(argv) == 0
    out = capsys.readouterr().out
    assert "IRMAS features, setting s: (24, 259, 38)" in out
    assert "cel 2, cla 3, flu 3" in out and "1 unreadable, 1 not stereo" in out
    assert irmas.main(argv) == 0 and "read from cache" in capsys.readouterr().out
    assert irmas.main(["--root", str(tmp_path / "nowhere")]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("python -m datasets.irmas: error: IRMAS root")


def test_an_unwritable_cache_warns_and_still_returns_features(tmp_path: Path, caplog) -> None:
    (tmp_path / "voi").mkdir()
    soundfile.write(tmp_path / "voi" / "a.wav", stereo_clip(4), RATE)
    blocker = tmp_path / "file-not-folder"
    blocker.write_text("x")
    data = extract(tmp_path, "l", blocker / "cache", workers=1, progress=False)
    assert data.features.shape == (1, 1034, 12)
    assert "could not write the IRMAS cache" in caplog.text

"""datasets.irmas on small wav trees that the tests write themselves."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import librosa
import numpy as np
import pytest
import soundfile
import torch
from helpers import ROOT, stereo_clip, write_tree

from datasets import irmas
from datasets.irmas import CLASSES, SETTINGS, IRMASError, extract

RATE = irmas.SAMPLE_RATE


@pytest.fixture(scope="module")
def tree(tmp_path_factory) -> Path:
    return write_tree(tmp_path_factory.mktemp("irmas") / "IRMAS-TrainingData")


@pytest.fixture(scope="module")
def small(tree: Path, tmp_path_factory) -> irmas.IRMASFeatures:
    return extract(tree, "s", tmp_path_factory.mktemp("cache"), workers=1, progress=False)


@pytest.mark.extended
def test_shapes_labels_and_reported_misfits(small: irmas.IRMASFeatures) -> None:
    n = 11 * 2 + 2  # the resampled and the padded clip are kept
    assert small.features.shape == (n, SETTINGS["s"].frames, SETTINGS["s"].features) == (n, 259, 38)
    assert small.features.dtype == torch.float32
    for rel, label in zip(small.files, small.labels.tolist(), strict=True):
        assert rel.split("/")[0] == CLASSES[label]
    assert {k: v for k, v in small.skipped.items() if v} == {
        "unreadable": ["gac/corrupt.wav"],
        "not stereo": ["cel/mono.wav"],
    }
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


def test_a_clip_replaced_with_its_size_and_mtime_kept_is_extracted_anew(tmp_path: Path) -> None:
    folder = one_class(tmp_path / "tree")
    soundfile.write(tmp_path / "tree" / "pia" / "other.wav", stereo_clip(9), RATE)
    cache = tmp_path / "cache"
    first = extract(tmp_path / "tree", "l", cache, workers=1, progress=False)
    clip = folder / "good.wav"
    before = clip.stat()
    soundfile.write(clip, stereo_clip(8), RATE)  # another clip, the same 16-bit wav size
    os.utime(clip, ns=(before.st_atime_ns, before.st_mtime_ns))
    assert (clip.stat().st_size, clip.stat().st_mtime_ns) == (before.st_size, before.st_mtime_ns)
    again = extract(tmp_path / "tree", "l", cache, workers=1, progress=False)
    assert not again.from_cache and again.cache_path != first.cache_path
    assert again.files == first.files == ["pia/good.wav", "pia/other.wav"]
    assert not torch.allclose(again.features[0], first.features[0], atol=1e-3)  # the new clip's
    assert torch.equal(again.features[1], first.features[1])  # the untouched clip's, the same
    assert extract(tmp_path / "tree", "l", cache, workers=1, progress=False).from_cache


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
    with pytest.raises(
        IRMASError, match=r"workers must be an integer from 0 \(all cores\) to the \d+ cores, got 5000"
    ):
        extract(tree, "s", workers=5000)
    with pytest.raises(IRMASError, match="cache_dir is empty; accepted: a folder path, or null"):
        extract(tree, "s", cache_dir="")


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


def _cli_refusal(argv: list[str], capsys) -> str:
    """The one line ``datasets.irmas`` refuses ``argv`` with, exit status 2 (argparse's or its own)."""
    try:
        code = irmas.main(argv)
    except SystemExit as stop:
        code = stop.code
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 2 and len(err) == 1
    return err[0].removeprefix("python -m datasets.irmas: error: ")


@pytest.mark.parametrize(
    ("options", "message"),
    [
        (["--root", ""], "IRMAS root '' is empty; expected the IRMAS training data"),
        (["--cache-dir", ""], "argument --cache-dir: an empty path; accepted: a folder (made if missing)"),
        (["--cache-dir", "{file}"], "argument --cache-dir: {file} is a file; accepted: a folder"),
        (["--cache-dir", "{file}/sub"], "argument --cache-dir: {file} is a file; accepted: a folder"),
        (["--cache-dir", "{denied}/c"], "argument --cache-dir: cannot write in {denied} (permission denied)"),
        (
            ["--workers", "abc"],
            "argument --workers: 'abc' is not an integer; accepted: non-negative integers",
        ),
    ],
)
def test_cli_refuses_bad_options_before_extracting(
    tree: Path, tmp_path: Path, capsys, monkeypatch, options: list[str], message: str
) -> None:
    paths = {"file": tmp_path / "a-file", "denied": tmp_path / "denied"}
    paths["file"].write_text("x")
    real = os.access  # as root every folder is writable: this one is not
    monkeypatch.setattr(os, "access", lambda path, mode: Path(path) != paths["denied"] and real(path, mode))
    paths["denied"].mkdir()
    monkeypatch.setattr(irmas, "load_clip", lambda *a, **k: pytest.fail("extracted"))
    monkeypatch.chdir(tree)  # a real IRMAS tree: an empty --root must not be read as it
    argv = ["--root", str(tree), "--cache-dir", str(tmp_path / "cache"), "--workers", "1"]
    line = _cli_refusal([*argv, *(o.format(**paths) for o in options)], capsys)
    assert line.startswith(message.format(**paths))
    assert not (tmp_path / "cache").exists() and paths["file"].read_text() == "x"


def test_an_empty_root_is_not_the_current_folder(tree: Path, monkeypatch) -> None:
    monkeypatch.chdir(tree)
    with pytest.raises(IRMASError, match="IRMAS root '' is empty"):
        extract("", "s", workers=1, progress=False)


def test_an_unwritable_cache_warns_and_still_returns_features(tmp_path: Path, caplog) -> None:
    (tmp_path / "voi").mkdir()
    soundfile.write(tmp_path / "voi" / "a.wav", stereo_clip(4), RATE)
    blocker = tmp_path / "file-not-folder"
    blocker.write_text("x")
    data = extract(tmp_path, "l", blocker / "cache", workers=1, progress=False)
    assert data.features.shape == (1, 1034, 12)
    assert f"cannot write {blocker / 'cache'}" in caplog.text and "the next run extracts again" in caplog.text
    assert data.cache_error.startswith(f"cannot write {blocker / 'cache'}")
    assert f"not cached: cannot write {blocker / 'cache'}" in irmas.report(data)


# ------------------------------------------------------------------------------------ input faults


def one_class(tmp_path: Path, name: str = "pia") -> Path:
    """A tree of one class folder holding one good clip."""
    (tmp_path / name).mkdir(parents=True)
    soundfile.write(tmp_path / name / "good.wav", stereo_clip(7), RATE)
    return tmp_path / name


def test_faulty_files_are_skipped_counted_and_named(tmp_path: Path, caplog) -> None:
    folder = one_class(tmp_path)
    bad = stereo_clip(8)
    bad[100, 0] = np.nan
    soundfile.write(folder / "nan.wav", bad, RATE, subtype="FLOAT")
    bad[100, 0] = np.inf
    soundfile.write(folder / "inf.wav", bad, RATE, subtype="FLOAT")
    (folder / "dangling.wav").symlink_to(tmp_path / "gone.wav")
    os.mkfifo(folder / "pipe.wav")  # read, it would block forever
    whole = (folder / "good.wav").read_bytes()
    (folder / "cut.wav").write_bytes(whole[: len(whole) // 2])
    data = extract(tmp_path, "l", tmp_path / "cache", workers=1, progress=False)
    assert data.files == ["pia/good.wav"]
    assert data.skipped["non-finite samples"] == ["pia/inf.wav", "pia/nan.wav"]
    assert data.skipped["unreadable"] == ["pia/dangling.wav", "pia/pipe.wav"]
    assert data.skipped["truncated"] == ["pia/cut.wav"]
    assert "skipped 1 truncated IRMAS file(s): pia/cut.wav" in caplog.text
    assert "2 unreadable, 1 truncated, 2 non-finite samples" in irmas.report(data)


def test_finite_samples_that_give_non_finite_features_are_skipped(tmp_path: Path, caplog) -> None:
    """Samples of 1e30 are finite, but their power spectrum overflows float32: NaN MFCCs."""
    tree = tmp_path / "tree"
    one_class(tree, "pia")
    one_class(tree, "voi")
    soundfile.write(tree / "voi" / "huge.wav", stereo_clip(8) * 1e30, RATE, subtype="FLOAT")
    data = extract(tree, "s", tmp_path / "cache", workers=1, progress=False)
    assert data.files == ["pia/good.wav", "voi/good.wav"]
    assert {k: v for k, v in data.skipped.items() if v} == {"non-finite features": ["voi/huge.wav"]}
    assert "skipped 1 non-finite features IRMAS file(s): voi/huge.wav" in caplog.text
    assert "skipped: 1 non-finite features;" in irmas.report(data)
    cached = torch.load(data.cache_path, weights_only=True)
    assert cached["features"].shape[0] == 2 and torch.isfinite(cached["features"]).all()


def test_a_clip_is_cut_to_its_length_before_it_is_resampled(tmp_path: Path, monkeypatch) -> None:
    """A header claiming 1 Hz: resampling all of it first would make millions of samples."""
    soundfile.write(tmp_path / "slow.wav", stereo_clip(3, seconds=2000, rate=1), 1)
    seen = []
    real = librosa.resample
    monkeypatch.setattr(librosa, "resample", lambda y, **kw: seen.append(y.shape) or real(y, **kw))
    features, fixes = irmas.load_clip(tmp_path / "slow.wav", SETTINGS["s"])
    assert seen == [(2, 3)] and fixes == ["resampled"]  # 3 s at 1 Hz
    assert features.shape == (259, 38)


def test_one_usable_clip_cannot_be_split(tmp_path: Path) -> None:
    one_class(tmp_path)
    with pytest.raises(IRMASError, match=r"holds 1 usable clip; a train and a test split need at least 2"):
        irmas.irmas_loaders(tmp_path, "s", batch_size=4, cache_dir=tmp_path / "cache", workers=1)


def test_an_unreadable_root_is_named(tmp_path: Path, monkeypatch) -> None:
    one_class(tmp_path)
    monkeypatch.setattr(irmas.os, "access", lambda path, mode: Path(path) != tmp_path)
    with pytest.raises(IRMASError, match=r"cannot read the IRMAS root .* \(permission denied\)"):
        extract(tmp_path, "s", tmp_path / "cache", workers=1)


def test_names_the_system_allows_are_read_whatever_their_case_or_encoding(tmp_path: Path) -> None:
    folder = one_class(tmp_path)
    soundfile.write(folder / "LOUD.WAV", stereo_clip(9), RATE)
    odd = os.fsencode(folder) + b"/caf\xe9.wav"  # Latin-1, not UTF-8
    with open(odd, "wb") as f:
        f.write((folder / "good.wav").read_bytes())
    data = extract(tmp_path, "l", tmp_path / "cache", workers=1, progress=False)
    assert data.files == ["pia/LOUD.WAV", "pia/caf\\xe9.wav", "pia/good.wav"]
    assert not any(data.skipped.values())
    irmas.report(data).encode("utf-8")  # printable as it is


def test_empty_and_unlistable_class_folders_are_named(tmp_path: Path, caplog, monkeypatch) -> None:
    one_class(tmp_path)
    (tmp_path / "cel").mkdir()
    (tmp_path / "voi").mkdir()
    real = Path.iterdir

    def refuse(self):
        if self.name == "voi":
            raise PermissionError(13, "Permission denied", str(self))
        return real(self)

    monkeypatch.setattr(Path, "iterdir", refuse)
    extract(tmp_path, "l", tmp_path / "cache", workers=1, progress=False)
    assert "IRMAS class folders without .wav clips under" in caplog.text and ": cel" in caplog.text
    assert f"cannot list the IRMAS class folder {tmp_path / 'voi'} (Permission denied)" in caplog.text


@pytest.mark.parametrize("damage", ["flipped bytes", "foreign file"])
def test_a_damaged_or_foreign_cache_is_extracted_anew(tmp_path: Path, caplog, damage: str) -> None:
    one_class(tmp_path)
    first = extract(tmp_path, "l", tmp_path / "cache", workers=1, progress=False)
    cache = Path(first.cache_path)
    if damage == "flipped bytes":
        raw = bytearray(cache.read_bytes())
        raw[len(raw) // 2] ^= 0xFF  # inside the features
        cache.write_bytes(bytes(raw))
    else:
        torch.save(torch.zeros(3), cache)
    again = extract(tmp_path, "l", tmp_path / "cache", workers=1, progress=False)
    assert not again.from_cache and torch.equal(again.features, first.features)
    assert f"ignoring the IRMAS cache {cache}" in caplog.text
    assert extract(tmp_path, "l", tmp_path / "cache", workers=1, progress=False).from_cache  # rewritten


@pytest.mark.extended
def test_killing_the_extraction_ends_its_workers(tmp_path: Path) -> None:
    tree = write_tree(tmp_path / "tree", per_class=6)
    command = [sys.executable, "-m", "datasets.irmas", "--root", str(tree), "--workers", "2"]
    command += ["--frames", "s", "--cache-dir", str(tmp_path / "cache")]
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    proc = subprocess.Popen(command, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    children: list[str] = []
    deadline = time.monotonic() + 120
    while len(children) < 2 and proc.poll() is None and time.monotonic() < deadline:
        task = Path(f"/proc/{proc.pid}/task/{proc.pid}/children")
        children = task.read_text().split() if task.exists() else []
        time.sleep(0.05)
    assert len(children) == 2, "the workers did not start"
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    deadline = time.monotonic() + 30
    while any(Path(f"/proc/{c}").exists() for c in children) and time.monotonic() < deadline:
        time.sleep(0.1)
    alive = [
        c
        for c in children
        if Path(f"/proc/{c}/status").exists() and "zombie" not in Path(f"/proc/{c}/status").read_text()
    ]
    assert alive == []


def test_the_synthetic_tree_has_irmas_layout_and_classes_apart(tmp_path: Path, capsys, monkeypatch) -> None:
    from datasets import synthetic_irmas

    assert synthetic_irmas.main(["--out", str(tmp_path / "t"), "--per-class", "12"]) == 0
    assert "11 classes x 12 clips" in capsys.readouterr().out
    for name in CLASSES:
        clips = sorted((tmp_path / "t" / name).glob("*.wav"))
        assert len(clips) == 12
    audio, rate = soundfile.read(tmp_path / "t" / "voi" / "voi11.wav")
    assert audio.shape == (3 * RATE, 2) and rate == RATE

    def pitch(name: str) -> float:  # the left channel's strongest frequency
        left = soundfile.read(tmp_path / "t" / name.rstrip("0123456789") / f"{name}.wav")[0][:, 0]
        return float(np.argmax(np.abs(np.fft.rfft(left)))) * RATE / len(left)

    # each class is a band of pitches of its own: the last clip of one is below the next class's first
    assert pitch("cel0") < pitch("cel11") < pitch("cla0") < pitch("voi11")
    with pytest.raises(SystemExit) as stop:
        synthetic_irmas.main(["--out", str(tmp_path / "u"), "--per-class", "0"])
    assert (
        stop.value.code == 2
        and "--per-class: 0 is not positive; accepted: 1 or more" in capsys.readouterr().err
    )
    assert not (tmp_path / "u").exists()
    # more clips than the disk holds: refused before the first is written
    assert (tmp_path / "t" / "voi" / "voi11.wav").stat().st_size == synthetic_irmas.CLIP_BYTES
    free = type("Usage", (), {"free": 110 * synthetic_irmas.CLIP_BYTES})
    monkeypatch.setattr(synthetic_irmas.shutil, "disk_usage", lambda path: free)
    with pytest.raises(SystemExit) as stop:
        synthetic_irmas.main(["--out", str(tmp_path / "u"), "--per-class", "11"])
    assert stop.value.code == 2
    assert (
        f"has {110 * synthetic_irmas.CLIP_BYTES / 1e9:.3g} GB free; accepted: 1 to 10"
        in capsys.readouterr().err
    )
    assert not (tmp_path / "u").exists()

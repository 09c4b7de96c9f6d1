"""IRMAS instrument recognition: MFCC features of the training clips, extracted once and cached.

The user provides the IRMAS training data (it is not bundled): a folder holding the 11 class folders
``cel cla flu gac gel org pia sax tru vio voi`` of stereo 44.1 kHz 3-second wav clips, as published at
https://www.upf.edu/web/mtg/irmas (IRMAS-TrainingData.zip). Labels come from the folder names.

Features (docs/DESIGN.md, section 2): the MFCC of each channel, coefficient 0 dropped, each coefficient
standardized over time (zero mean, unit population variance; a constant coefficient becomes 0),
both channels concatenated (channel 0's coefficients first), frames along time: (N, T, F) float32.

    setting   hop   n_fft   n_mfcc   F    T (frames of a 3 s clip)
    s         512   4096    20       38   259
    m         256   2048    13       24   517
    l         128   1024    7        12   1034

Clips are the ``.wav`` files (any case of the suffix) in the class folders. Those that do not fit,
decided here and reported, with their names, by ``extract`` and the CLI:

* unreadable files (not audio, empty, a link to nothing, a name the system cannot open, a pipe or
  device rather than a file) are skipped and counted;
* truncated files (shorter than their own header says) are skipped and counted: what is missing is
  not silence;
* files with NaN or infinite samples are skipped and counted;
* files whose features come out NaN or infinite (finite samples so large that their power spectrum
  overflows float32) are skipped and counted, so the cache never holds a non-finite value;
* files that are not stereo (mono, or more than two channels) are skipped and counted: the features
  are defined on two channels, and duplicating one would invent a stereo image;
* another sample rate is resampled to 44.1 kHz (librosa, soxr) and counted; the clip is cut to 3 s
  first, so a header claiming a very low rate cannot blow up into millions of samples;
* another length is cropped to its first 3 s, or zero-padded at the end to 3 s, and counted.

A class folder that is missing, empty or cannot be listed is named in a warning. If nothing usable
is left, extraction fails with one line that says so; the loaders need at least 2 usable clips, one
for each split.

Extraction runs in worker processes with a progress bar (they end with the process that started
them, however it ends) and is cached on disk as one file per (setting, file list): the key hashes
the settings and every clip's relative path, size, modification time and the sha256 of its bytes, so
a changed tree, clip or setting computes anew, even a clip replaced by another of the same size with
its modification time restored (reading and hashing IRMAS's ~6,700 clips, about 3.5 GB, takes
seconds, against minutes to extract them). The cache holds a checksum of its contents and is checked
when read: a damaged or foreign file at the cache path is extracted anew. It is written to a
temporary name and renamed into place, so a killed run never leaves a file that reads as complete; a
cache that cannot be written is reported, and the features are used all the same (the CLI, whose only
output is the cache, refuses a ``--cache-dir`` it cannot write before extracting).

    python -m datasets.irmas --root DIR --frames m
"""

from __future__ import annotations

import concurrent.futures as cf
import contextlib
import ctypes
import hashlib
import json
import logging
import math
import multiprocessing
import os
import signal
import stat
import sys
import time
from collections import Counter
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from functools import partial
from pathlib import Path
from typing import ClassVar

import numpy as np
import torch
from torch.utils.data import DataLoader, Subset, TensorDataset

from toolbox.cli import OneLineParser, cpu_cores, is_count, non_negative_int
from toolbox.errors import DataError
from toolbox.files import output_folder, write_atomic

log = logging.getLogger(__name__)

CLASSES: tuple[str, ...] = ("cel", "cla", "flu", "gac", "gel", "org", "pia", "sax", "tru", "vio", "voi")
SAMPLE_RATE = 44_100
CLIP_SAMPLES = 3 * SAMPLE_RATE
IRMAS_URL = "https://www.upf.edu/web/mtg/irmas"
# bumped when features or the key change (3: a clip is cut to 3 s before it is resampled;
# 4: non-finite features are skipped, and each clip is keyed on its bytes too)
CACHE_VERSION = 4
SKIP_REASONS = ("unreadable", "truncated", "non-finite samples", "not stereo", "non-finite features")
FIX_REASONS = ("resampled", "length adjusted")


@dataclass(frozen=True)
class FeatureSettings:
    """One of the paper's MFCC settings."""

    hop: int
    n_fft: int
    n_mfcc: int

    @property
    def features(self) -> int:
        return 2 * (self.n_mfcc - 1)

    @property
    def frames(self) -> int:
        return 1 + CLIP_SAMPLES // self.hop


SETTINGS: dict[str, FeatureSettings] = {
    "s": FeatureSettings(512, 4096, 20),
    "m": FeatureSettings(256, 2048, 13),
    "l": FeatureSettings(128, 1024, 7),
}


class IRMASError(DataError):
    """A problem with the user's IRMAS folder or options, said in one line."""


def settings_for(frames: str) -> FeatureSettings:
    if frames not in SETTINGS:
        raise IRMASError(f"unknown IRMAS frames setting {frames!r}; accepted: {', '.join(SETTINGS)}")
    return SETTINGS[frames]


def default_cache_dir() -> Path:
    """``$XDG_CACHE_HOME/bppsa/irmas``, or ``~/.cache/bppsa/irmas``."""
    base = os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache"
    return Path(base) / "bppsa" / "irmas"


def shown(path: str | Path) -> str:
    """A path as it can be printed: bytes that are not UTF-8 shown as escapes."""
    return os.fsencode(path).decode("utf-8", "backslashreplace")


def find_clips(root: str | Path) -> list[tuple[Path, int]]:
    """(wav path, class index) for every clip under the class folders of ``root``, sorted."""
    expected = (
        f"expected the IRMAS training data: a folder holding the class folders {' '.join(CLASSES)} "
        f"of .wav clips (get IRMAS-TrainingData.zip from {IRMAS_URL}; it is not bundled)"
    )
    if not str(root).strip():  # Path('') would read as the current folder
        raise IRMASError(f"IRMAS root {str(root)!r} is empty; {expected}")
    root = Path(root).expanduser()
    if not root.is_dir():
        raise IRMASError(f"IRMAS root {shown(root)!r} does not exist or is not a folder; {expected}")
    if not os.access(root, os.R_OK | os.X_OK):
        raise IRMASError(f"cannot read the IRMAS root {shown(root)!r} (permission denied); {expected}")
    clips, missing, empty = [], [], []
    for label, name in enumerate(CLASSES):
        folder = root / name
        if not folder.is_dir():
            missing.append(name)
            continue
        try:
            wavs = sorted(p for p in folder.iterdir() if p.suffix.lower() == ".wav")
        except OSError as exc:
            log.warning(
                "cannot list the IRMAS class folder %s (%s); its clips are left out",
                shown(folder),
                exc.strerror,
            )
            continue
        if not wavs:
            empty.append(name)
        clips += [(p, label) for p in wavs]
    if not clips:
        raise IRMASError(f"IRMAS root {shown(root)!r} holds no class folder with .wav clips; {expected}")
    if missing:
        log.warning("IRMAS root %s lacks the class folders %s", shown(root), " ".join(missing))
    if empty:
        log.warning("IRMAS class folders without .wav clips under %s: %s", shown(root), " ".join(empty))
    return clips


def clip_features(audio: np.ndarray, settings: FeatureSettings) -> np.ndarray:
    """(frames, F) float32 features of one (2, CLIP_SAMPLES) clip at 44.1 kHz."""
    import librosa

    # One call per channel: a two-channel call would clip both channels' dB range (top_db) at the
    # louder channel's maximum, which is not "the MFCC of each channel".
    mfcc = np.stack(
        [
            librosa.feature.mfcc(
                y=channel,
                sr=SAMPLE_RATE,
                n_mfcc=settings.n_mfcc,
                n_fft=settings.n_fft,
                hop_length=settings.hop,
            )[1:]  # coefficient 0 dropped
            for channel in audio
        ]
    )  # (2, n_mfcc - 1, frames)
    mean = mfcc.mean(axis=-1, keepdims=True)
    std = mfcc.std(axis=-1, keepdims=True)
    standardized = (mfcc - mean) / np.maximum(std, 1e-8)
    return standardized.reshape(settings.features, -1).T.astype(np.float32)


def load_clip(path: Path, settings: FeatureSettings) -> tuple[np.ndarray | None, list[str]]:
    """Features of one wav file, or None; and what was skipped or fixed (SKIP_REASONS, FIX_REASONS)."""
    import soundfile

    if path.exists() and not path.is_file():  # a pipe or a device named .wav: reading it would block
        return None, ["unreadable"]
    try:
        with open(path, "rb") as f:  # opened here: libsndfile cannot open every name the system can
            if _truncated(f):
                return None, ["truncated"]
            audio, rate = soundfile.read(f, dtype="float32", always_2d=True)
    except Exception:  # libsndfile's errors differ by format and version: any is 'unreadable'
        return None, ["unreadable"]
    if audio.shape[0] == 0:
        return None, ["unreadable"]
    if not np.isfinite(audio).all():
        return None, ["non-finite samples"]
    if audio.shape[1] != 2:
        return None, ["not stereo"]
    # the clip's length at its own rate, before any resampling: a header claiming a very low rate
    # would otherwise be resampled to millions of samples first
    audio = np.ascontiguousarray(audio[: math.ceil(CLIP_SAMPLES * rate / SAMPLE_RATE)].T)
    fixes = []
    if rate != SAMPLE_RATE:
        import librosa

        audio = librosa.resample(audio, orig_sr=rate, target_sr=SAMPLE_RATE)
        fixes.append("resampled")
    if audio.shape[1] != CLIP_SAMPLES:
        audio = audio[:, :CLIP_SAMPLES]
        audio = np.pad(audio, ((0, 0), (0, CLIP_SAMPLES - audio.shape[1])))
        fixes.append("length adjusted")
    # checked below, by file: NumPy's overflow warnings from inside librosa would name no file
    with np.errstate(over="ignore", invalid="ignore", divide="ignore"):
        features = clip_features(audio, settings)
    if not np.isfinite(features).all():  # finite samples can still overflow float32 in the spectrum
        return None, ["non-finite features"]
    return features, fixes


def _truncated(f) -> bool:
    """Whether a RIFF/WAVE file is shorter than its header says (libsndfile reads what is there)."""
    head = f.read(12)
    f.seek(0)
    if len(head) < 12 or head[:4] != b"RIFF" or head[8:12] != b"WAVE":
        return False
    declared = 8 + int.from_bytes(head[4:8], "little")
    return os.fstat(f.fileno()).st_size < declared


@dataclass
class IRMASFeatures:
    """Extracted features with their provenance."""

    features: torch.Tensor  # (N, T, F) float32
    labels: torch.Tensor  # (N,) int64, indices into CLASSES
    files: list[str]  # relative paths, one per row
    frames: str
    skipped: dict[str, list[str]] = field(default_factory=dict)  # reason -> relative paths
    fixed: dict[str, int] = field(default_factory=dict)  # reason -> count
    cache_path: str = ""
    from_cache: bool = False
    seconds: float = 0.0
    cache_error: str | None = None  # why the cache could not be written, if it could not

    def per_class(self) -> dict[str, int]:
        counts = Counter(self.labels.tolist())
        return {c: counts.get(i, 0) for i, c in enumerate(CLASSES)}


def _content_hash(path: Path, st: os.stat_result) -> str | None:
    """sha256 of a regular file's bytes; None for anything else or a file that cannot be read
    (load_clip then names it unreadable)."""
    if not stat.S_ISREG(st.st_mode):  # a pipe named .wav: reading it would block
        return None
    try:
        with open(path, "rb") as f:
            return hashlib.file_digest(f, "sha256").hexdigest()
    except OSError:
        return None


def _listing(root: Path, clips: Sequence[tuple[Path, int]]) -> list[list]:
    """[relative path, size, modification time, sha256 of the bytes] of every clip; None for a clip
    that cannot be looked at (a link to nothing, a file removed meanwhile)."""
    listing = []
    for path, _ in clips:
        try:
            st = path.stat()
        except OSError:
            listing.append(None)
            continue
        rel = os.fsencode(path.relative_to(root)).hex()
        listing.append([rel, st.st_size, st.st_mtime_ns, _content_hash(path, st)])
    return listing


def cache_key(listing: list, settings: FeatureSettings) -> str:
    """Hash of the settings and every clip's relative path, size, modification time and content: a
    clip replaced by another of the same size and modification time still changes it."""
    blob = json.dumps(
        {
            "version": CACHE_VERSION,
            "settings": asdict(settings),
            "rate": SAMPLE_RATE,
            "samples": CLIP_SAMPLES,
            "files": listing,
        },
        sort_keys=True,
    )
    return hashlib.sha256(blob.encode()).hexdigest()[:20]


CACHED = {
    "features": torch.Tensor,
    "labels": torch.Tensor,
    "files": list,
    "frames": str,
    "skipped": dict,
    "fixed": dict,
}


def _checksum(payload: dict) -> str:
    """sha256 of everything a cache file holds but the checksum itself."""
    h = hashlib.sha256()
    for key in ("features", "labels"):
        h.update(payload[key].contiguous().numpy().tobytes())
    rest = {k: payload[k] for k in ("files", "frames", "skipped", "fixed")}
    h.update(json.dumps(rest, sort_keys=True).encode("utf-8", "surrogatepass"))
    return h.hexdigest()


def _read_cache(path: Path) -> dict | None:
    """The cached payload at ``path``; None (with a warning) when it is missing, unreadable, not an
    IRMAS cache, or damaged (its checksum does not match)."""
    if not path.is_file():
        return None
    try:
        payload = torch.load(path, weights_only=True)
        if not isinstance(payload, dict) or not all(isinstance(payload.get(k), t) for k, t in CACHED.items()):
            raise ValueError("not an IRMAS feature cache")
        if payload.get("checksum") != _checksum(payload):
            raise ValueError("its checksum does not match its contents")
    except Exception as exc:  # damaged or foreign: compute anew rather than fail or use it
        log.warning("ignoring the IRMAS cache %s (%s); extracting anew", path, str(exc).splitlines()[0])
        return None
    return {k: payload[k] for k in CACHED}


def _die_with_parent() -> None:
    """In a worker process: end when the process that started it ends, however it ends (Linux)."""
    with contextlib.suppress(OSError, AttributeError):
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
    if os.getppid() == 1:  # the parent is already gone
        os._exit(1)


def _extract_all(paths: list[Path], settings: FeatureSettings, workers: int, progress: bool):
    """load_clip over all paths, in order, in ``workers`` processes (1: in this process)."""
    from tqdm import tqdm

    job = partial(load_clip, settings=settings)
    bar = {
        "total": len(paths),
        "desc": "IRMAS features",
        "unit": "clip",
        "disable": None if progress else True,
    }
    if workers <= 1:
        return [job(p) for p in tqdm(paths, **bar)]
    # fork where there is one: workers start at once and need no __main__ guard in the caller's
    # script; they run NumPy and librosa only, never torch, so its thread pools are not at risk.
    methods = multiprocessing.get_all_start_methods()
    ctx = multiprocessing.get_context("fork" if "fork" in methods else None)
    pool = cf.ProcessPoolExecutor(max_workers=workers, mp_context=ctx, initializer=_die_with_parent)
    try:
        chunk = max(1, min(16, len(paths) // (4 * workers)))
        results = list(tqdm(pool.map(job, paths, chunksize=chunk), **bar))
    except BaseException:  # Ctrl-C or a failure: no worker is left behind
        for process in list(getattr(pool, "_processes", {}).values()):
            process.kill()
        pool.shutdown(wait=False, cancel_futures=True)
        raise
    pool.shutdown()
    return results


def extract(
    root: str | Path,
    frames: str = "m",
    cache_dir: str | Path | None = None,
    workers: int | None = None,
    progress: bool = True,
) -> IRMASFeatures:
    """Features of every usable clip under ``root``, from the cache when it matches."""
    settings = settings_for(frames)
    cores = cpu_cores()
    if workers is not None and not (is_count(workers, minimum=0) and workers <= cores):
        raise IRMASError(
            f"workers must be an integer from 0 (all cores) to the {cores} cores, got {workers!r}"
        )
    if cache_dir is not None and not str(cache_dir).strip():
        raise IRMASError(
            f"cache_dir is empty; accepted: a folder path, or null for the default ({default_cache_dir()})"
        )
    # an empty root is left for find_clips to refuse: resolved, it would name the current folder
    root = Path(root).expanduser().resolve() if str(root).strip() else root
    clips = find_clips(root)
    listing = _listing(root, clips)
    cache = Path(cache_dir).expanduser() if cache_dir is not None else default_cache_dir()
    path = cache / f"irmas-{frames}-{cache_key(listing, settings)}.pt"
    t0 = time.perf_counter()
    cached = _read_cache(path)
    if cached is not None:
        return IRMASFeatures(
            **cached, cache_path=str(path), from_cache=True, seconds=time.perf_counter() - t0
        )

    skipped: dict[str, list[str]] = {r: [] for r in SKIP_REASONS}
    usable = []
    for (clip, label), entry in zip(clips, listing, strict=True):
        if entry is None:
            skipped["unreadable"].append(shown(clip.relative_to(root)))
        else:
            usable.append((clip, label))
    n_workers = workers or cores
    results = _extract_all([p for p, _ in usable], settings, n_workers, progress)
    feats, labels, files = [], [], []
    fixed = dict.fromkeys(FIX_REASONS, 0)
    for (clip, label), (feat, notes) in zip(usable, results, strict=True):
        rel = shown(clip.relative_to(root).as_posix())
        for note in notes:
            if note in skipped:
                skipped[note].append(rel)
            else:
                fixed[note] += 1
        if feat is not None:
            feats.append(feat)
            labels.append(label)
            files.append(rel)
    for reason, which in skipped.items():
        if which:
            log.warning("skipped %d %s IRMAS file(s): %s", len(which), reason, ", ".join(which[:5]))
    if not feats:
        counts = ", ".join(f"{len(v)} {k}" for k, v in skipped.items() if v)
        raise IRMASError(f"no usable clips under {shown(root)!r} ({counts}); expected stereo wav files")
    payload = {
        "features": torch.from_numpy(np.stack(feats)),
        "labels": torch.tensor(labels, dtype=torch.int64),
        "files": files,
        "frames": frames,
        "skipped": skipped,
        "fixed": fixed,
    }
    error = None
    try:
        write_atomic(path, lambda tmp: torch.save({**payload, "checksum": _checksum(payload)}, tmp))
    except OSError as exc:  # the features are still good: say so, and carry on without a cache
        error = str(exc)
        log.warning("%s; the next run extracts again", error)
    return IRMASFeatures(**payload, cache_path=str(path), seconds=time.perf_counter() - t0, cache_error=error)


def irmas_loaders(
    root: str | Path,
    frames: str,
    batch_size: int,
    cache_dir: str | Path | None = None,
    workers: int | None = None,
    train_fraction: float = 0.8,
    seed: int = 0,
    loader_workers: int = 0,
) -> tuple[DataLoader, DataLoader]:
    """Train and test loaders over a seeded random split of the (cached) features.

    ``workers``: feature-extraction processes (``extract``); ``loader_workers``: DataLoader worker
    processes (the features are in memory, so 0 is usually best).
    """
    if not is_count(batch_size):
        raise IRMASError(f"batch_size must be a positive integer, got {batch_size!r}")
    if not 0.0 < train_fraction < 1.0:
        raise IRMASError(f"train_fraction must lie strictly between 0 and 1, got {train_fraction!r}")
    data = extract(root, frames, cache_dir, workers)
    if len(data.labels) < 2:
        raise IRMASError(
            f"IRMAS root {shown(root)!r} holds {len(data.labels)} usable clip; a train and a test split "
            "need at least 2"
        )
    full = TensorDataset(data.features, data.labels)
    order = torch.randperm(len(full), generator=torch.Generator().manual_seed(seed)).tolist()
    cut = max(1, min(len(full) - 1, round(len(full) * train_fraction))) if len(full) > 1 else 1
    train, test = Subset(full, order[:cut]), Subset(full, order[cut:])
    shuffle = torch.Generator().manual_seed(seed)
    common = {"batch_size": batch_size, "num_workers": loader_workers}
    return (
        DataLoader(train, shuffle=True, generator=shuffle, **common),
        DataLoader(test, shuffle=False, **common),
    )


@dataclass(frozen=True)
class IRMAS:
    """IRMAS as the suite trains on it (``conf/dataset/irmas.yaml``): its loaders, its name and its
    class count, which the records carry. Nothing is read until ``loaders`` is called."""

    root: str
    frames: str = "m"
    cache_dir: str | None = None
    train_fraction: float = 0.8
    seed: int = 0
    name: ClassVar[str] = "irmas"
    classes: ClassVar[int] = len(CLASSES)

    def loaders(self, batch_size: int, workers: int = 0) -> tuple[DataLoader, DataLoader]:
        """Train and test loaders (``irmas_loaders``); ``workers``: DataLoader worker processes."""
        return irmas_loaders(
            self.root, self.frames, batch_size, self.cache_dir, None, self.train_fraction, self.seed, workers
        )


def report(data: IRMASFeatures) -> str:
    """What the CLI prints: clips per class, shape, skips and fixes, time, cache."""
    lines = [
        f"IRMAS features, setting {data.frames}: {tuple(data.features.shape)} (clips, frames, features)",
        "clips per class: " + ", ".join(f"{c} {n}" for c, n in data.per_class().items()),
    ]
    skipped = ", ".join(f"{len(v)} {k}" for k, v in data.skipped.items() if v) or "none"
    fixed = ", ".join(f"{n} {k}" for k, n in data.fixed.items())
    lines.append(f"skipped: {skipped}; fixed: {fixed}")
    rate = "" if data.from_cache else f" ({len(data.files) / max(data.seconds, 1e-9):.1f} clips/s)"
    if data.from_cache:
        lines.append(f"read from cache in {data.seconds:.1f} s: {data.cache_path}")
    elif data.cache_error:
        lines.append(f"extracted in {data.seconds:.1f} s{rate}; not cached: {data.cache_error}")
    else:
        lines.append(f"extracted and cached in {data.seconds:.1f} s{rate}: {data.cache_path}")
    return "\n".join(lines)


def main(argv: Sequence[str] | None = None) -> int:
    parser = OneLineParser(
        prog="python -m datasets.irmas",
        description="Extract and cache IRMAS MFCC features.",
    )
    parser.add_argument("--root", required=True, help="folder with the 11 IRMAS class folders")
    parser.add_argument("--frames", default="m", help="feature setting: s, m or l")
    # the cache is this command's only output: one it cannot write is refused before extracting
    parser.add_argument(
        "--cache-dir",
        type=lambda text: output_folder(os.path.expanduser(text)),
        default=str(default_cache_dir()),
        help="where the features are cached",
    )
    parser.add_argument(
        "--workers",
        type=non_negative_int,
        default=None,
        help="processes (default or 0: all cores; 1: no subprocess)",
    )
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.WARNING, format="%(levelname)s: %(message)s")
    try:
        data = extract(args.root, args.frames, args.cache_dir, args.workers)
    except IRMASError as exc:
        print(f"{parser.prog}: error: {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:  # the workers end with this process; a cache is written whole or not at all
        print(f"{parser.prog}: interrupted", file=sys.stderr)
        return 130
    print(report(data))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

"""A synthetic stand-in for the IRMAS training data, in its published layout.

    python -m datasets.synthetic_irmas --out data/irmas-synthetic --per-class 12

Writes the 11 IRMAS class folders (``cel cla flu gac gel org pia sax tru vio voi``), each holding
``--per-class`` stereo 44.1 kHz 3-second wav clips. A clip is two tones with a little noise: the left
at 150 + 40·s Hz, the right at 330 Hz with phase s, for the clip's seed s = k·stride + i (class k,
clip i, stride = max(10, per-class)). Each class is a band of pitches of its own, so a classifier
can learn it. This is not music. What it shares with IRMAS is the shape: the same folders, rate,
length and channels, hence the same feature shapes (s / m / l: 259 x 38, 517 x 24, 1034 x 12
frames x features). Timing experiments depend on that shape, not on the content. The tests and the
reproduction report use it where the real data is not available.
"""

from __future__ import annotations

import shutil
from collections.abc import Sequence
from pathlib import Path

import numpy as np

from datasets.irmas import CLASSES, CLIP_SAMPLES, SAMPLE_RATE
from toolbox.cli import OneLineParser, bounded
from toolbox.files import nearest_folder, output_folder

# A clip on disk: 16-bit stereo samples and the 44-byte header of a wav file.
CLIP_BYTES = 44 + CLIP_SAMPLES * 2 * 2


def stereo_clip(seed: int, seconds: float = 3.0, rate: int = SAMPLE_RATE) -> np.ndarray:
    """Two distinct tones with a little noise: (samples, 2) float32."""
    rng = np.random.default_rng(seed)
    t = np.arange(int(seconds * rate)) / rate
    tone = np.stack([np.sin(2 * np.pi * (150 + 40 * seed) * t), np.sin(2 * np.pi * 330 * t + seed)], axis=1)
    return (0.3 * tone + 0.02 * rng.standard_normal(tone.shape)).astype(np.float32)


def write_synthetic(root: str | Path, per_class: int) -> Path:
    """The 11 class folders under ``root`` (made if missing), ``per_class`` clips each; returns root."""
    import soundfile

    if per_class < 1:
        raise ValueError(f"per-class count {per_class} is not positive; accepted: 1 or more")
    root = Path(root)
    stride = max(10, per_class)
    for k, name in enumerate(CLASSES):
        (root / name).mkdir(parents=True, exist_ok=True)
        for i in range(per_class):
            soundfile.write(root / name / f"{name}{i}.wav", stereo_clip(k * stride + i), SAMPLE_RATE)
    return root


def main(argv: Sequence[str] | None = None) -> int:
    parser = OneLineParser(
        prog="python -m datasets.synthetic_irmas",
        description="Write a synthetic IRMAS training folder: 11 classes of stereo 44.1 kHz 3 s clips.",
    )
    parser.add_argument(
        "--out", type=output_folder, required=True, help="the folder to write (its class folders are made)"
    )
    parser.add_argument("--per-class", type=bounded(int, "1 or more"), default=12, help="clips per class")
    args = parser.parse_args(argv)
    folder = nearest_folder(args.out.resolve())
    free, per_class = shutil.disk_usage(folder).free, len(CLASSES) * CLIP_BYTES
    if args.per_class * per_class > free:
        parser.error(
            f"--per-class {args.per_class} needs {args.per_class * per_class / 1e9:.3g} GB, "
            f"and {folder} has {free / 1e9:.3g} GB free; accepted: 1 to {free // per_class}"
        )
    root = write_synthetic(args.out, args.per_class)
    print(f"{root}: {len(CLASSES)} classes x {args.per_class} clips")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

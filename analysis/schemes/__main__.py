"""``python -m analysis.schemes``."""

from analysis.schemes import main

if __name__ == "__main__":
    raise SystemExit(main())

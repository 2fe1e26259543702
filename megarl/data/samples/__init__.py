"""Small made-up dataset files in the real datasets' schemas, for tests and CPU recipes (written by make_samples)."""

from pathlib import Path

SAMPLES_DIR = Path(__file__).resolve().parent

"""Session fixtures shared by every test folder."""

from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="session")
def smollm2_dir() -> Path:
    """SmolLM2-135M-Instruct as an HF folder (written once per machine, ~20 s; git-ignored)."""
    from torchtitan_rl.models.fetch import fetch

    return fetch("smollm2-135m-instruct", REPO / "models" / "smollm2-135m-instruct")

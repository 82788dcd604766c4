"""The README's Python examples run as written."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

README = Path(__file__).resolve().parents[1] / "README.md"
BLOCKS = re.findall(r"```python\n(.*?)```", README.read_text(), re.DOTALL)
RUNNABLE = BLOCKS


def test_readme_has_its_examples():
    assert len(RUNNABLE) >= 3


@pytest.mark.parametrize("index", range(len(RUNNABLE)))
def test_readme_example_runs(index, tiny_path):
    namespace: dict = {"__name__": "readme_example"}
    exec(compile(RUNNABLE[index], f"README.md block {index}", "exec"), namespace)

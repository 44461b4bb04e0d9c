"""The README's Python example runs as written."""

import os
import re

from conftest import ROOT


def test_readme_python_example_runs(tmp_path, monkeypatch):
    readme = open(os.path.join(ROOT, "README.md"), encoding="utf-8").read()
    example = re.search(r"```python\n(import torch\nimport ddl.*?)```", readme, re.S).group(1)
    assert len(example.strip().splitlines()) <= 12
    monkeypatch.chdir(tmp_path)
    exec(compile(example, "README.md", "exec"), {})
    assert (tmp_path / "tiny-ddl" / "modeling_ddl.py").exists()

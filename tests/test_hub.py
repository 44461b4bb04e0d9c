"""`train.py --push_to_hub` against a fake Hub (huggingface_hub's upload calls copy into local folders, one per commit):
every pushed revision, in-progress ones included, loads with trust_remote_code in a fresh process where `ddl` is
not importable, carries the model card, and holds no pickle; `python -m ddl_tools.hub` pushes a finished folder the
same way.
"""

import os
import shutil
import subprocess
import sys
from concurrent.futures import Future

import pytest
from huggingface_hub import HfApi
from huggingface_hub.utils import filter_repo_objects

from test_train import TINY_RUN, env, text_file, tiny  # noqa: F401 (text_file: a fixture)


class FakeHub:
    """Commits as folders `hub/<n>` (what the repo holds after commit n), messages in order."""

    def __init__(self, root):
        self.root, self.messages = root, []

    def create_repo(self, api, repo_id, **kwargs):
        from huggingface_hub import RepoUrl

        return RepoUrl(f"https://huggingface.co/{repo_id}")

    def upload_folder(self, api, *, repo_id, folder_path, commit_message=None, path_in_repo=None,
                      ignore_patterns=None, allow_patterns=None, run_as_future=False, **kwargs):
        previous = self.root / str(len(self.messages) - 1)
        revision = self.root / str(len(self.messages))
        if previous.exists():  # a commit adds and replaces files; it deletes none
            shutil.copytree(previous, revision)
        names = [os.path.relpath(os.path.join(d, f), folder_path)
                 for d, _, files in os.walk(folder_path) for f in files]
        for name in filter_repo_objects(names, allow_patterns=allow_patterns, ignore_patterns=ignore_patterns):
            target = revision / (path_in_repo or "") / name
            target.parent.mkdir(parents=True, exist_ok=True)
            shutil.copy(os.path.join(folder_path, name), target)
        self.messages.append(commit_message)
        if run_as_future:
            done = Future()
            done.set_result(None)
            return done
        return None

    def revisions(self):
        return [self.root / str(i) for i in range(len(self.messages))]


@pytest.fixture
def fake_hub(tmp_path, monkeypatch):
    hub = FakeHub(tmp_path / "hub")
    monkeypatch.setattr(HfApi, "create_repo", lambda api, repo_id, **kw: hub.create_repo(api, repo_id, **kw))
    monkeypatch.setattr(HfApi, "upload_folder", lambda api, **kw: hub.upload_folder(api, **kw))
    return hub


def pickles(folder):
    """Files that are pickles: a bare pickle (protocol 2+ starts with 0x80) or torch.save's zip around one."""
    found = []
    for path in folder.rglob("*"):
        if path.is_file():
            head = path.read_bytes()[:4]
            if head[:1] == b"\x80" or head == b"PK\x03\x04":
                found.append(str(path.relative_to(folder)))
    return found


LOAD_ALL = """
import sys, torch
sys.modules["ddl"] = None  # `import ddl` raises ImportError: remote code must do the work
from transformers import AutoModel, AutoModelForCausalLM, AutoTokenizer
for path in sys.argv[1:]:
    model = AutoModelForCausalLM.from_pretrained(path, trust_remote_code=True)
    assert type(model).__module__.startswith("transformers_modules"), type(model).__module__
    assert AutoModel.from_pretrained(path, trust_remote_code=True).config.model_type == "ddl"
    tokenizer = AutoTokenizer.from_pretrained(path, trust_remote_code=True)
    ids = tokenizer("The king", return_tensors="pt")
    assert model.generate(**ids, max_new_tokens=3, do_sample=False).shape[1] > ids["input_ids"].shape[1]
    print("loaded", path)
"""


def load_in_fresh_process(tmp_path, folders):
    environment = env(HF_HOME=str(tmp_path / "hf"))
    environment.pop("PYTHONPATH", None)
    proc = subprocess.run([sys.executable, "-c", LOAD_ALL, *map(str, folders)], cwd=tmp_path, env=environment,
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-4000:]
    assert proc.stdout.count("loaded") == len(folders)


def test_every_pushed_revision_loads_and_holds_no_pickle(tmp_path, text_file, fake_hub, capsys):  # noqa: F811
    import train

    out = tmp_path / "run"
    args = tiny(out, text_file, "--max_steps", "4", "--save_steps", "2", "--eval_steps", "2", "--push_to_hub",
                "--hub_model_id", "me/tiny-ddl", "--report_to", "tensorboard")
    assert train.cli(args) == 0, capsys.readouterr().err[-3000:]
    revisions = fake_hub.revisions()
    for revision in revisions:
        assert pickles(revision) == [], revision
        names = {p.name for p in revision.iterdir()}
        assert {"config.json", "model.safetensors", "modeling_ddl.py", "configuration_ddl.py", "tokenizer.json",
                "README.md", "generation_config.json"} <= names, (revision, names)
        assert not any(n.startswith(("checkpoint-", "runs")) for n in names), names
        assert "trust_remote_code=True" in (revision / "README.md").read_text()
    assert fake_hub.messages == ["Training in progress, step 2", "Training in progress, step 4", "End of training"]
    assert "Training in progress** (step 2 of 4)" in (revisions[0] / "README.md").read_text()
    assert "Training in progress" not in (revisions[-1] / "README.md").read_text()
    assert {"loss_curve.png", "all_results.json", "training_args.json"} <= {p.name for p in revisions[-1].iterdir()}
    load_in_fresh_process(tmp_path, revisions)
    # The output folder itself holds no pickle outside the checkpoints that resume the run.
    assert [p for p in pickles(out) if not p.startswith("checkpoint-")] == []


def test_hub_strategy_that_pushes_pickles_is_refused(tmp_path, text_file, fake_hub, capsys):  # noqa: F811
    import train

    status = train.cli(tiny(tmp_path / "run", text_file, "--max_steps", "1", "--push_to_hub", "--hub_model_id",
                            "me/x", "--hub_strategy", "checkpoint"))
    err = capsys.readouterr().err
    assert status == 2 and "--hub_strategy checkpoint would push" in err, err[-2000:]
    assert fake_hub.messages == [] and not (tmp_path / "run").exists()


def test_push_a_finished_folder(tmp_path, fake_hub, capsys):
    """`python -m ddl_tools.hub FOLDER REPO`: a train.py-like folder (checkpoint, logs, a pickle beside the model)
    goes up as the model alone, through the same filter as train.py's pushes."""
    import torch

    import ddl
    from ddl_tools import hub

    from conftest import tiny_config, tiny_tokenizer

    folder = tmp_path / "outputs"
    tokenizer = tiny_tokenizer()
    ddl.DDLForCausalLM(tiny_config(vocab_size=len(tokenizer))).save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    model_files = sorted(p.name for p in folder.iterdir())
    (folder / "checkpoint-5").mkdir()
    torch.save({"state": 1}, folder / "checkpoint-5" / "optimizer.pt")
    torch.save({"args": 1}, folder / "training_args.bin")
    (folder / "runs").mkdir()
    (folder / "runs" / "events.out").write_text("log")
    assert hub.main([str(folder), "me/tiny"]) == 0
    (revision,) = fake_hub.revisions()
    assert sorted(p.name for p in revision.iterdir()) == model_files  # the model: loads as the test above shows
    assert hub.main([str(tmp_path / "nothing"), "me/tiny"]) == 2
    assert "not a saved model folder" in capsys.readouterr().err

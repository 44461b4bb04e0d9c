"""The task heads (sequence and token classification, extractive QA), as Llama has them: Auto classes, padding,
losses, save/load, and remote code in a fresh process without `ddl`."""

import json
import os
import subprocess
import sys

import pytest
import torch
from transformers import (
    AutoModelForQuestionAnswering,
    AutoModelForSequenceClassification,
    AutoModelForTokenClassification,
)

from conftest import TINY, seeded, tiny_config
from ddl import DDLForCausalLM, DDLForQuestionAnswering, DDLForSequenceClassification, DDLForTokenClassification


pytestmark = pytest.mark.device  # (runs on DDL_TEST_DEVICE: see conftest.py)


HEADS = {
    DDLForSequenceClassification: AutoModelForSequenceClassification,
    DDLForTokenClassification: AutoModelForTokenClassification,
    DDLForQuestionAnswering: AutoModelForQuestionAnswering,
}
STATES = [
    pytest.param({"ddl_value_channels": 1}, id="dv1"),
    pytest.param({"ddl_value_channels": 4, "ddl_compressor": "cc", "ddl_embed_conv": True}, id="dv4-cc-ec"),
]
PAD = TINY["pad_token_id"]


def _head(head_class, seed=0, **overrides):
    """A head with trained-looking weights: every parameter moved off its initial value (zero gate weights, identity
    convolutions, zero head biases), so that pooling the wrong token or leaking a pad would show."""
    torch.manual_seed(seed)
    model = head_class(tiny_config(num_labels=3, **overrides)).eval()
    with torch.no_grad():
        for param in model.parameters():
            param.add_(0.1 * torch.randn_like(param))
    return model


def _rows():
    g = seeded(3)
    return [torch.randint(3, TINY["vocab_size"], (n,), generator=g) for n in (7, 4, 2)]


def _padded(rows, side):
    """The rows as one batch padded with the pad token on `side`, and its attention mask."""
    width = max(len(r) for r in rows)
    ids = torch.full((len(rows), width), PAD)
    mask = torch.zeros_like(ids)
    for i, row in enumerate(rows):
        span = slice(width - len(row), width) if side == "left" else slice(0, len(row))
        ids[i, span], mask[i, span] = row, 1
    return ids, mask


def _real(tensor, i, row, width, side):
    """Row i's values at its real tokens."""
    return tensor[i, width - len(row):] if side == "left" else tensor[i, : len(row)]


def test_auto_classes_resolve_every_head():
    for head_class, auto_class in HEADS.items():
        assert type(auto_class.from_config(tiny_config(num_labels=3))) is head_class


@pytest.mark.parametrize("side", ["left", "right"])
@pytest.mark.parametrize("overrides", [*STATES, pytest.param({"qk_norm": True}, id="dv4-cc-ec-qk-norm")])
def test_padded_batch_gives_each_row_its_own_outputs(overrides, side):
    """(With QK-norm after the rotary embedding, the presets', attention is not shift-invariant: left padding moved
    a row's positions and its outputs, up to 0.02 in a classifier's logits, until positions counted real tokens.)"""
    rows = _rows()
    ids, mask = _padded(rows, side)
    width = ids.shape[1]
    with torch.no_grad():
        cls = _head(DDLForSequenceClassification, **overrides)
        batch = cls(ids, attention_mask=mask).logits
        for i, row in enumerate(rows):
            torch.testing.assert_close(batch[i], cls(row[None]).logits[0], rtol=0, atol=1e-5)
        tok = _head(DDLForTokenClassification, **overrides)
        batch = tok(ids, attention_mask=mask).logits
        for i, row in enumerate(rows):
            torch.testing.assert_close(_real(batch, i, row, width, side), tok(row[None]).logits[0], rtol=0, atol=1e-5)
        qa = _head(DDLForQuestionAnswering, **overrides)
        out = qa(ids, attention_mask=mask)
        for i, row in enumerate(rows):
            alone = qa(row[None])
            for key in ("start_logits", "end_logits"):
                torch.testing.assert_close(_real(out[key], i, row, width, side), alone[key][0], rtol=0, atol=1e-5)


@pytest.mark.parametrize("overrides", STATES)
def test_losses_are_the_standard_ones_and_train_the_whole_model(overrides):
    rows = _rows()
    ids, mask = _padded(rows, "left")
    cross_entropy = torch.nn.functional.cross_entropy

    cls = _head(DDLForSequenceClassification, **overrides)
    labels = torch.tensor([2, 0, 1])
    out = cls(ids, attention_mask=mask, labels=labels)
    torch.testing.assert_close(out.loss, cross_entropy(out.logits, labels))
    out.loss.backward()
    for name, param in cls.named_parameters():
        if name != "model.embed_tokens.weight":  # (its pad row gets no gradient; the rest is checked below)
            assert param.grad is not None and param.grad.abs().sum() > 0, name
    assert cls.model.embed_tokens.weight.grad[ids[mask.bool()]].abs().sum() > 0

    regression = _head(DDLForSequenceClassification, **overrides)
    regression.config.num_labels, regression.config.problem_type = 1, "regression"
    regression.score = torch.nn.Linear(TINY["hidden_size"], 1, bias=False)
    targets = torch.tensor([0.5, -1.0, 2.0])
    out = regression(ids, attention_mask=mask, labels=targets)
    torch.testing.assert_close(out.loss, torch.nn.functional.mse_loss(out.logits.squeeze(-1), targets))

    tok = _head(DDLForTokenClassification, **overrides)
    token_labels = torch.randint(0, 3, ids.shape, generator=seeded(4))
    token_labels = token_labels.masked_fill(mask == 0, -100)
    out = tok(ids, attention_mask=mask, labels=token_labels)
    real = mask.bool()
    torch.testing.assert_close(out.loss, cross_entropy(out.logits[real], token_labels[real]))

    qa = _head(DDLForQuestionAnswering, **overrides)
    starts, ends = torch.tensor([1, 4, 5]), torch.tensor([3, 6, 6])
    out = qa(ids, attention_mask=mask, start_positions=starts, end_positions=ends)
    expected = (cross_entropy(out.start_logits, starts) + cross_entropy(out.end_logits, ends)) / 2
    torch.testing.assert_close(out.loss, expected)


@pytest.mark.parametrize("overrides", STATES)
def test_save_and_load_through_the_auto_classes(overrides, tmp_path):
    ids, mask = _padded(_rows(), "left")
    for head_class, auto_class in HEADS.items():
        model = _head(head_class, **overrides)
        model.config.id2label = {0: "comedy", 1: "history", 2: "tragedy"}
        model.config.label2id = {v: k for k, v in model.config.id2label.items()}
        model.save_pretrained(tmp_path / head_class.__name__)
        loaded = auto_class.from_pretrained(tmp_path / head_class.__name__).eval()
        assert type(loaded) is head_class and loaded.config.id2label[2] == "tragedy"
        with torch.no_grad():
            for key, value in model(ids, attention_mask=mask).items():
                if torch.is_tensor(value):
                    torch.testing.assert_close(loaded(ids, attention_mask=mask)[key], value, rtol=1e-5, atol=1e-6)


REMOTE_SCRIPT = r"""
import json, sys
import torch
sys.modules["ddl"] = None  # as for someone who never installed ddl: `import ddl` raises ImportError
from transformers import (AutoModelForQuestionAnswering, AutoModelForSequenceClassification,

                          AutoModelForTokenClassification, AutoTokenizer, pipeline)
expected = json.load(open(sys.argv[1]))
ids = torch.tensor(expected.pop("ids"))
for auto_name, (folder, values) in expected.items():
    model = getattr(sys.modules["transformers"], auto_name).from_pretrained(folder, trust_remote_code=True).eval()
    assert type(model).__module__.startswith("transformers_modules"), type(model).__module__
    with torch.no_grad():
        out = model(ids)
    got = out.logits if "QuestionAnswering" not in auto_name else torch.stack([out.start_logits, out.end_logits])
    assert torch.allclose(got, torch.tensor(values), atol=1e-5), (auto_name, (got - torch.tensor(values)).abs().max())
# a causal LM checkpoint becomes a classifier to fine-tune: its base model, a fresh score
lm_folder = sys.argv[2]
clf = AutoModelForSequenceClassification.from_pretrained(lm_folder, num_labels=2, trust_remote_code=True)
lm = torch.load(sys.argv[3])
assert all(torch.equal(clf.state_dict()[name], value) for name, value in lm.items()), "base weights not loaded"
tok = AutoTokenizer.from_pretrained(lm_folder, trust_remote_code=True)
result = pipeline("text-classification", model=clf, tokenizer=tok)(["To be", "or not to be, that is"])
assert [r["label"] for r in result] and all(0 < r["score"] <= 1 for r in result), result
print("REMOTE-HEADS-OK")
"""


@pytest.mark.parametrize("overrides", STATES)
def test_remote_code_loads_every_head_in_a_fresh_process(overrides, tmp_path, tokenizer):
    ids = [[5, 6, 7, 8, 9, 10]]
    expected = {"ids": ids}
    for head_class, auto_class in HEADS.items():
        model = _head(head_class, **overrides)
        folder = tmp_path / head_class.__name__
        model.save_pretrained(folder)
        with torch.no_grad():
            out = model(torch.tensor(ids))
        values = out.logits if head_class is not DDLForQuestionAnswering else torch.stack(
            [out.start_logits, out.end_logits])
        expected[auto_class.__name__] = (str(folder), values.tolist())
    auto_map = json.loads((tmp_path / "DDLForTokenClassification" / "config.json").read_text())["auto_map"]
    assert {auto_class.__name__ for auto_class in HEADS.values()} <= set(auto_map)

    torch.manual_seed(0)
    lm = DDLForCausalLM(tiny_config(**overrides, vocab_size=len(tokenizer), pad_token_id=tokenizer.pad_token_id))
    lm.save_pretrained(tmp_path / "lm")
    tokenizer.save_pretrained(tmp_path / "lm")
    torch.save({name: value for name, value in lm.state_dict().items() if name.startswith("model.")},
               tmp_path / "lm_base.pt")

    (tmp_path / "expected.json").write_text(json.dumps(expected))
    (tmp_path / "check.py").write_text(REMOTE_SCRIPT)
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    env.update(HF_HOME=str(tmp_path / "hf_home"), HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1")
    result = subprocess.run(
        [sys.executable, str(tmp_path / "check.py"), str(tmp_path / "expected.json"), str(tmp_path / "lm"),
         str(tmp_path / "lm_base.pt")],
        cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300, stdin=subprocess.DEVNULL,
    )
    assert result.returncode == 0 and "REMOTE-HEADS-OK" in result.stdout, result.stdout + result.stderr[-5000:]

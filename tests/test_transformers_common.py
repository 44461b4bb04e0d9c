"""transformers' own common model tests (`ModelTesterMixin` and `TrainingTesterMixin`, from transformers' source
distribution on PyPI) run on
DDL, d_v = 1 and the expanded state (d_v = 4, CC, EC), and on Llama as the control, with one tester written here.

The harness is not in the transformers wheel: `scripts/transformers_common_tests.sh` fetches the sdist of the
installed version into a cache folder and runs this module; without it this module skips. What the sdist holds and
lacks (its `tests/generation/` and `tests/exporters/` are not packaged, so `GenerationTesterMixin` cannot run and the
script puts empty stand-ins there for `test_modeling_common.py` to import) is in the script.

To the harness DDL is what an in-library model is: its classes are entered, for this module only, in transformers'
name tables (`MODEL_MAPPING_NAMES`, `MODEL_FOR_CAUSAL_LM_MAPPING_NAMES`, ...), by which the mixin chooses each class's
labels and which classes it trains, as the library's own entries do for Llama.
"""

import os
import sys
import unittest
from unittest import mock

import pytest
import torch


HARNESS = os.environ.get("DDL_TRANSFORMERS_TESTS") or os.path.join(
    os.path.expanduser("~"), ".cache", "ddl", "transformers-tests"
)


def _harness_folder():
    import transformers

    folder = os.path.join(HARNESS, transformers.__version__)
    return folder if os.path.isfile(os.path.join(folder, "transformers_tests", "test_modeling_common.py")) else None


if _harness_folder() is None:
    pytest.skip("transformers' test harness is not fetched; run scripts/transformers_common_tests.sh",
                allow_module_level=True)
pytest.importorskip("parameterized", reason="transformers' test harness needs `parameterized` (pip install it)")
sys.path.insert(0, _harness_folder())

from transformers import LlamaConfig  # noqa: E402
from transformers.models.auto import modeling_auto  # noqa: E402
from transformers.models.llama.modeling_llama import (  # noqa: E402
    LlamaForCausalLM,
    LlamaForQuestionAnswering,
    LlamaForSequenceClassification,
    LlamaForTokenClassification,
    LlamaModel,
)
from transformers_tests.generation.test_utils import GenerationTesterMixin  # noqa: E402
from transformers_tests.test_modeling_common import ModelTesterMixin, ids_tensor  # noqa: E402
from transformers_tests.test_training_mixin import TrainingTesterMixin  # noqa: E402

from ddl import (  # noqa: E402
    DDLConfig,
    DDLForCausalLM,
    DDLForQuestionAnswering,
    DDLForSequenceClassification,
    DDLForTokenClassification,
    DDLModel,
)


DDL_NAMES = {
    "MODEL_MAPPING_NAMES": "DDLModel",
    "MODEL_FOR_CAUSAL_LM_MAPPING_NAMES": "DDLForCausalLM",
    "MODEL_FOR_SEQUENCE_CLASSIFICATION_MAPPING_NAMES": "DDLForSequenceClassification",
    "MODEL_FOR_TOKEN_CLASSIFICATION_MAPPING_NAMES": "DDLForTokenClassification",
    "MODEL_FOR_QUESTION_ANSWERING_MAPPING_NAMES": "DDLForQuestionAnswering",
}


@pytest.fixture(scope="module", autouse=True)
def ddl_in_transformers_name_tables():
    patches = [mock.patch.dict(getattr(modeling_auto, table), {DDLConfig.model_type: name})
               for table, name in DDL_NAMES.items()]
    for patch in patches:
        patch.start()
    yield
    for patch in patches:
        patch.stop()


class CausalModelTester:
    """Config and inputs for the mixin: a decoder-only model of Llama's shape at the size transformers tests use."""

    batch_size = 13
    seq_length = 7
    is_training = True
    vocab_size = 99
    hidden_size = 32
    num_hidden_layers = 2
    num_attention_heads = 4
    num_key_value_heads = 2
    intermediate_size = 37
    num_labels = 3
    num_choices = 4
    pad_token_id = 0

    def __init__(self, parent, config_class, causal_lm_class, **config_overrides):
        self.parent = parent
        self.config_class = config_class
        self.causal_lm_class = causal_lm_class  # what TrainingTesterMixin trains
        self.config_overrides = config_overrides

    def get_config(self):
        return self.config_class(
            vocab_size=self.vocab_size, hidden_size=self.hidden_size, num_hidden_layers=self.num_hidden_layers,
            num_attention_heads=self.num_attention_heads, num_key_value_heads=self.num_key_value_heads,
            intermediate_size=self.intermediate_size, hidden_act="silu", max_position_embeddings=512,
            num_labels=self.num_labels, pad_token_id=self.pad_token_id, bos_token_id=1, eos_token_id=2,
            **self.config_overrides,
        )

    def prepare_config_and_inputs_for_common(self):
        input_ids = ids_tensor([self.batch_size, self.seq_length], self.vocab_size)
        # right padding of every length (row i keeps i + 1 tokens), then full rows
        attention_mask = torch.tril(torch.ones_like(input_ids))
        return self.get_config(), {"input_ids": input_ids, "attention_mask": attention_mask}


class _CommonTests(ModelTesterMixin, GenerationTesterMixin, TrainingTesterMixin):
    config_class = None
    config_overrides = {}

    def setUp(self):
        causal_lm_class = next(c for c in self.all_model_classes if c.__name__.endswith("ForCausalLM"))
        self.model_tester = CausalModelTester(self, self.config_class, causal_lm_class, **self.config_overrides)


class LlamaControlTest(_CommonTests, unittest.TestCase):
    """The control: the same tests on transformers' own Llama classes."""

    config_class = LlamaConfig
    all_model_classes = (
        LlamaModel, LlamaForCausalLM, LlamaForSequenceClassification, LlamaForTokenClassification,
        LlamaForQuestionAnswering,
    )


class DDLScalarStateTest(_CommonTests, unittest.TestCase):
    """DDL with d_v = 1: the residual state is the usual (B, T, d) vector."""

    config_class = DDLConfig
    config_overrides = {"ddl_value_channels": 1}
    all_model_classes = (
        DDLModel, DDLForCausalLM, DDLForSequenceClassification, DDLForTokenClassification, DDLForQuestionAnswering,
    )


class DDLExpandedStateTest(DDLScalarStateTest):
    """DDL's default: d_v = 4 value channels, the CC compressor and the EC embedding convolution."""

    config_overrides = {"ddl_value_channels": 4, "ddl_compressor": "cc", "ddl_embed_conv": True}

import os
import sys

import pytest
import torch


ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if ROOT not in sys.path:
    sys.path.insert(0, ROOT)

# Nothing in the tests may reach the Hugging Face Hub.
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
# Triton kernels run through its interpreter on CPU; the flag must be set before triton is first imported.
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")
torch.set_num_threads(1)  # tiny models: threads only add synchronisation (and fight over 2 cores)

TINY = dict(
    vocab_size=99,
    hidden_size=32,
    intermediate_size=64,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=128,
    pad_token_id=0,
    bos_token_id=1,
    eos_token_id=2,
)


def tiny_config(**overrides):
    from ddl import DDLConfig

    return DDLConfig(**{**TINY, **overrides})


def tiny_tokenizer(text=None, vocab_size=300):
    """A byte-level BPE trained in-process (no Hub access) by train.py's own trainer, left padding, as it saves it."""
    from ddl.training import train_bpe_tokenizer

    text = text or ("To be, or not to be, that is the question:\nWhether 'tis nobler in the mind to suffer\n" * 20)
    return train_bpe_tokenizer([text.splitlines()], vocab_size)


@pytest.fixture(scope="session")
def tokenizer():
    return tiny_tokenizer()

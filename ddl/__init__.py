"""Deep Delta Learning for 🤗 transformers: `import ddl` registers the Auto classes.

What a checkpoint ships: `configuration_ddl` (DDLConfig), `modeling_ddl` (the model), `reference` (the operations'
specifications), `ops` (the one place that chooses each operation's implementation: the specification, or the
`ddl_kernels` package's C++ and Triton when installed) and `packing` (packed and padded batches).
"""

from transformers import (
    AutoConfig,
    AutoModel,
    AutoModelForCausalLM,
    AutoModelForQuestionAnswering,
    AutoModelForSequenceClassification,
    AutoModelForTokenClassification,
)

from . import modeling_ddl
from .configuration_ddl import DDLConfig
from .modeling_ddl import (
    DDLForCausalLM,
    DDLForQuestionAnswering,
    DDLForSequenceClassification,
    DDLForTokenClassification,
    DDLModel,
    DDLPreTrainedModel,
)
from .reference import delta_update


AutoConfig.register(DDLConfig.model_type, DDLConfig, exist_ok=True)
# Each Auto class and its DDL model, once: registered here, and (register_for_auto_class) written by save_pretrained
# into config.json's auto_map, with the model's .py files copied next to the weights.
AUTO_CLASSES = {
    AutoModel: DDLModel,
    AutoModelForCausalLM: DDLForCausalLM,
    AutoModelForSequenceClassification: DDLForSequenceClassification,
    AutoModelForTokenClassification: DDLForTokenClassification,
    AutoModelForQuestionAnswering: DDLForQuestionAnswering,
}
DDLConfig.register_for_auto_class()
for auto_class, model_class in AUTO_CLASSES.items():
    auto_class.register(DDLConfig, model_class, exist_ok=True)
    model_class.register_for_auto_class(auto_class.__name__)

__all__ = ["DDLConfig", *modeling_ddl.__all__, "delta_update"]

"""Deep Delta Learning for 🤗 transformers: `import ddl` registers the Auto classes.

What a checkpoint ships: `configuration_ddl` (DDLConfig), `modeling_ddl` (the model), `reference` (the operations'
specifications), `kernels` (the one place that chooses each operation's implementation), and the fast paths it
chooses from: `fused` (PyTorch), `cpu_kernels` (C++, source in `cpu_kernels_source`), `triton_kernels` (CUDA).
"""

from transformers import (
    AutoConfig,
    AutoModel,
    AutoModelForCausalLM,
    AutoModelForQuestionAnswering,
    AutoModelForSequenceClassification,
    AutoModelForTokenClassification,
)

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
AutoModel.register(DDLConfig, DDLModel, exist_ok=True)
AutoModelForCausalLM.register(DDLConfig, DDLForCausalLM, exist_ok=True)
AutoModelForSequenceClassification.register(DDLConfig, DDLForSequenceClassification, exist_ok=True)
AutoModelForTokenClassification.register(DDLConfig, DDLForTokenClassification, exist_ok=True)
AutoModelForQuestionAnswering.register(DDLConfig, DDLForQuestionAnswering, exist_ok=True)
# save_pretrained writes these into config.json's auto_map and copies the model's .py files next to the weights.
DDLConfig.register_for_auto_class()
DDLModel.register_for_auto_class("AutoModel")
DDLForCausalLM.register_for_auto_class("AutoModelForCausalLM")
DDLForSequenceClassification.register_for_auto_class("AutoModelForSequenceClassification")
DDLForTokenClassification.register_for_auto_class("AutoModelForTokenClassification")
DDLForQuestionAnswering.register_for_auto_class("AutoModelForQuestionAnswering")

__all__ = [
    "DDLConfig",
    "DDLForCausalLM",
    "DDLForQuestionAnswering",
    "DDLForSequenceClassification",
    "DDLForTokenClassification",
    "DDLModel",
    "DDLPreTrainedModel",
    "delta_update",
]

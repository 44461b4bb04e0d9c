"""Deep Delta Learning for 🤗 transformers: `import ddl` registers the Auto classes."""

from transformers import AutoConfig, AutoModel, AutoModelForCausalLM

from .configuration_ddl import DDLConfig
from .modeling_ddl import DDLForCausalLM, DDLModel, DDLPreTrainedModel, delta_update


AutoConfig.register(DDLConfig.model_type, DDLConfig, exist_ok=True)
AutoModel.register(DDLConfig, DDLModel, exist_ok=True)
AutoModelForCausalLM.register(DDLConfig, DDLForCausalLM, exist_ok=True)
# save_pretrained writes these into config.json's auto_map and copies the model's .py files next to the weights.
DDLConfig.register_for_auto_class()
DDLModel.register_for_auto_class("AutoModel")
DDLForCausalLM.register_for_auto_class("AutoModelForCausalLM")

__all__ = ["DDLConfig", "DDLForCausalLM", "DDLModel", "DDLPreTrainedModel", "delta_update"]

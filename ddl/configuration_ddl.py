"""DDL model configuration: Llama's configuration plus one group of `ddl_*` fields."""

import transformers
from packaging.version import Version


# The oldest transformers this code runs on (pyproject's bound), checked where loading starts and before the imports
# it would fail in: the version imported, not the installed metadata (a source tree on PYTHONPATH has none).
MIN_TRANSFORMERS = "5.24"
if Version(transformers.__version__) < Version(MIN_TRANSFORMERS):
    raise ImportError(f"DDL needs transformers>={MIN_TRANSFORMERS}, this is {transformers.__version__}: "
                      f"pip install -U 'transformers>={MIN_TRANSFORMERS}'")

from huggingface_hub.dataclasses import strict  # noqa: E402
from transformers.models.llama.configuration_llama import LlamaConfig  # noqa: E402


CHOICES = {"ddl_compressor": ("cc", "tc"), "ddl_residual": ("delta", "write_only", "additive"),
           "ddl_value_input": ("state", "context"), "ddl_cc_form": ("conv", "matrix"),
           "ddl_initialization": ("authors", "llama"), "qk_norm_position": ("after_rope", "before_rope")}
# The defaults follow the authors' code (github.com/yifanzhang-pro/deep-delta-learning at d1f76215,
# docs/faithfulness.md). A config.json saved before these fields existed was trained with ddl's earlier choices: it
# loads with these values.
LEGACY_DEFAULTS = {"ddl_shared_compressor": False, "ddl_cc_form": "matrix", "ddl_initialization": "llama",
                   "ddl_beta_hidden_bias": True, "qk_norm_position": "before_rope"}
# Lets the Auto classes load a saved folder with trust_remote_code=True without `ddl` installed, the task heads too (a
# causal LM fine-tuned as a classifier); `transformers serve` loads by AutoModelForDecision (else it looks the class
# up on the transformers module, where no checkpoint's own class is).
AUTO_MAP = {"AutoConfig": "configuration_ddl.DDLConfig", "AutoModel": "modeling_ddl.DDLModel",
            "AutoModelForCausalLM": "modeling_ddl.DDLForCausalLM",
            "AutoModelForDecision": "modeling_ddl.DDLForCausalLM",
            "AutoModelForSequenceClassification": "modeling_ddl.DDLForSequenceClassification",
            "AutoModelForTokenClassification": "modeling_ddl.DDLForTokenClassification",
            "AutoModelForQuestionAnswering": "modeling_ddl.DDLForQuestionAnswering"}


def conv_state_slots(config) -> dict[tuple[int, str], int]:
    """Where each token-axis convolution keeps its history in the generation cache: `{(layer_idx, role): slot}`, role
    `"attn"` / `"mlp"` (TC compressors), `"embed"` (EC, in layer 0), `"readout"` (the final TC readout, in the last
    layer); kernel 1 has no history. The config derives its cache fields from it, the model reads the same map."""
    slots, num_layers = {}, config.num_hidden_layers
    tc = config.ddl_value_channels > 1 and config.ddl_compressor == "tc" and config.ddl_state_kernel_size > 1
    ec = config.ddl_embed_conv and config.ddl_embed_kernel_size > 1
    for layer_idx in range(num_layers):
        roles = ["attn", "mlp"] if tc else []
        roles += ["embed"] * (layer_idx == 0 and ec) + ["readout"] * (layer_idx == num_layers - 1 and tc)
        slots.update({(layer_idx, role): slot for slot, role in enumerate(roles)})
    return slots


@strict
class DDLConfig(LlamaConfig):
    r"""
    Configuration of a Deep Delta Learning (DDL) language model (Zhang et al., 2026, arXiv 2601.00417).

    Every field of [`LlamaConfig`] keeps Llama's name, default and meaning; with `ddl_residual="additive"` and
    `ddl_value_channels=1` the model *is* Llama. The DDL fields replace each residual `x + F(norm(x))` by

        X <- X + beta * k (v^T - k^T X),   k = h / sqrt(|h|^2 + eps_k^2),   beta = 2 sigmoid(w . c + b)

    with `c = RMSNorm(x_in)` the sublayer input, `h = F(c)` the sublayer output and `v` a learned target.

    Args:
        ddl_value_channels (`int`, *optional*, defaults to 4):
            d_v, the value channels of the residual state `X` (d x d_v per token): 1 = the ordinary residual vector;
            the paper's default "DDL" is 4.
        ddl_compressor (`str`, *optional*, defaults to `"cc"`):
            How a d x d_v state is read as a width-d sublayer input (and the final readout): `"cc"` per-feature
            weights over the d_v channels, or `"tc"` a causal depthwise conv over tokens, then a read vector.
        ddl_shared_compressor (`bool`, *optional*, defaults to True):
            True: one compressor per block, before the attention and again before the MLP (the authors' code).
            False: one per sublayer (ddl's earlier layout). The final readout is its own compressor either way.
        ddl_cc_form (`str`, *optional*, defaults to `"conv"`):
            `"conv"` (the authors'): a depthwise convolution along each feature's d_v axis (`ddl_cc_kernel_size`
            taps, "same" zero padding), then a read vector over d_v. `"matrix"`: a free d x d_v weight (ddl's earlier
            form). Both compute x_in[i] = sum_j w[i, j] X[j, i].
        ddl_cc_kernel_size (`int`, *optional*):
            Taps of the CC convolution along d_v, 1 <= K <= d_v; None = d_v (the authors' default).
        ddl_state_kernel_size (`int`, *optional*, defaults to 4):
            Token-axis kernel of the TC compressor (>= 1; 1 = no token mixing).
        ddl_embed_conv (`bool`, *optional*):
            EC: the d x d_v state from a causal depthwise convolution of the token embeddings (identity at init);
            None (the default) is d_v > 1, resolved when the config is made; False required when d_v == 1. Without EC
            the embedding is repeated over the d_v channels.
        ddl_embed_kernel_size (`int`, *optional*, defaults to 4):
            Token-axis kernel of EC (>= 1).
        ddl_residual (`str`, *optional*, defaults to `"delta"`):
            `"delta"`: X + beta k (v^T - k^T X) (the method). `"write_only"`: X + beta k v^T (no erase term; the
            control the paper calls decisive). `"additive"`: X + h (Llama when d_v == 1; else h on every channel).
        ddl_beta_init (`float`, *optional*, defaults to 1.0):
            Initial gate beta in [0, 2]: 0 = identity, 1 = projection (k^T X overwritten with v), 2 = reflection:
            the gate bias logit(beta_init / 2) (|logit| <= 9.21), its weights small (zero with "llama" init).
        ddl_beta_hidden_size (`int`, *optional*):
            None = a linear gate `w . c + b`; an int = the width of a gate `w2 . tanh(W1 c [+ b1]) + b2` (128).
        ddl_beta_hidden_bias (`bool`, *optional*, defaults to False):
            Whether the two-layer gate's hidden layer has a bias b1 (the authors' has none).
        ddl_k_eps (`float`, *optional*, defaults to 1e-5):
            eps_k in k = h / sqrt(|h|^2 + eps_k^2). Keeps k finite (zero) when a sublayer output is all zeros.
        ddl_v_sigmoid_scale (`float`, *optional*, defaults to 4.0):
            Bound of the value: v = scale * sigmoid(W_v u + b_v) in (0, scale). None = unbounded linear value.
        ddl_v_constant (`float`, *optional*):
            A fixed target v on every channel, no value projection (the authors' option uses 2.0); None = learned.
        ddl_value_input (`str`, *optional*, defaults to `"state"`):
            What the value projection reads: `"state"` = the un-normalised sublayer input x_in (the authors' code,
            which produced the paper's numbers); `"context"` = the normalised context c (the paper's text).
        qk_norm (`bool`, *optional*, defaults to False):
            RMSNorm on queries and keys per head (the paper's runs; the presets): `self_attn.q_norm` / `k_norm`.
        qk_norm_position (`str`, *optional*, defaults to `"after_rope"`):
            `"after_rope"` on the rotated queries and keys (the authors' code) or `"before_rope"` (Qwen3's).
        ddl_initialization (`str`, *optional*, defaults to `"authors"`):
            `"authors"`: their spectral scheme, matrices ~ N(0, f / sqrt(fan_in) * min(1, sqrt(fan_out / fan_in)))
            (f = `ddl_init_std_factor`; output projections divided by the depth), embeddings ~ N(0,
            initializer_range), compressors at the average (taps 1/K, read 1/d_v), EC at identity. `"llama"`:
            transformers' N(0, initializer_range), the gate weight and value bias zero, CC at the channels' average,
            TC and EC at identity (ddl's earlier choice).
        ddl_init_std_factor (`float`, *optional*, defaults to 0.5):
            f of the authors' initialisation (their `hidden_init_std_factor`).
        ddl_rebuild_states (`bool`, *optional*, defaults to True):
            Training with d_v > 1 in fp32/fp64: rebuild each expanded state in backward from the next one instead of
            keeping it (`modeling_ddl.StateRebuild`: less memory, the same gradients up to rounding). False keeps the
            states, for a second derivative (`create_graph=True`, with `ddl_implementation="reference"`) or code that
            changes a state in place.
        ddl_autocast_state (`bool`, *optional*, defaults to False):
            Under autocast, the state in autocast's dtype, as the authors' code has it: half its bytes, kept for
            backward (not rebuilt). False: the embeddings' dtype (fp32 with fp32 weights), rebuilt where allowed.

        ddl_implementation (`str`, *optional*):
            How DDL's operations run here, a runtime choice never saved (like `attn_implementation`): `"auto"`,
            `"triton"`, `"torch"` or `"reference"` (`ddl.ops` says what each runs); None = `ddl.ops`' default.

    Read from these (properties, never stale): `layer_types` marks the layers whose cache also holds token-conv
    histories (`"hybrid"`), `number_of_conv_states` how many, for `generate()`'s cache."""

    model_type = "ddl"
    keys_to_ignore_at_inference = ["cache"]

    @property
    def base_model_tp_plan(self):  # Llama's, and QK-norm's per-head norms: split heads, so all-reduced grads (Qwen3)
        norms = ("layers.*.self_attn.q_norm", "layers.*.self_attn.k_norm") if self.qk_norm else ()
        return {**LlamaConfig.base_model_tp_plan, **dict.fromkeys(norms, "replicated_with_grad_allreduce")}

    ddl_value_channels: int = 4
    ddl_compressor: str = "cc"
    ddl_shared_compressor: bool = True
    ddl_cc_form: str = "conv"
    ddl_cc_kernel_size: int | None = None
    ddl_state_kernel_size: int = 4
    ddl_embed_conv: bool | None = None
    ddl_embed_kernel_size: int = 4
    ddl_residual: str = "delta"
    ddl_beta_init: float = 1.0
    ddl_beta_hidden_size: int | None = None
    ddl_beta_hidden_bias: bool = False
    ddl_k_eps: float = 1e-5
    ddl_v_sigmoid_scale: float | None = 4.0
    ddl_v_constant: float | None = None
    ddl_value_input: str = "state"
    qk_norm: bool = False
    qk_norm_position: str = "after_rope"
    ddl_initialization: str = "authors"
    ddl_init_std_factor: float = 0.5
    ddl_rebuild_states: bool = True
    ddl_autocast_state: bool = False
    ddl_implementation: str | None = None

    def __post_init__(self, **kwargs):
        if kwargs.pop("ddl_impl", None) == "reference":  # (checkpoints saved when it was a saved field)
            self.ddl_implementation = self.ddl_implementation or "reference"
        for derived in ("layer_types", "number_of_conv_states", "per_layer_config"):  # (a saved config.json's copies)
            kwargs.pop(derived, None)
        if self.ddl_embed_conv is None:
            self.ddl_embed_conv = self.ddl_value_channels > 1
        kwargs["auto_map"] = {**AUTO_MAP, **(kwargs.get("auto_map") or {})}
        super().__post_init__(**kwargs)

    @property
    def layer_types(self) -> list[str]:
        """`"hybrid"` for the layers whose cache also keeps token-convolution inputs (EC, TC), else `"full_attention"`."""
        layers = {layer_idx for layer_idx, _ in conv_state_slots(self)}
        return ["hybrid" if i in layers else "full_attention" for i in range(self.num_hidden_layers)]

    @property
    def number_of_conv_states(self) -> int:
        """Token-convolution inputs a hybrid cache layer keeps (the most any layer needs; unused ones stay empty)."""
        layers = [layer_idx for layer_idx, _ in conv_state_slots(self)]
        return max([0] + [layers.count(i) for i in range(self.num_hidden_layers)])  # (as torch.compile traces it)

    @classmethod
    def from_dict(cls, config_dict, **kwargs):
        """A saved config; one written before the authors' defaults (no `ddl_shared_compressor` in it) keeps the
        choices it was trained with (`LEGACY_DEFAULTS`)."""
        if "ddl_value_channels" in config_dict and "ddl_shared_compressor" not in config_dict:
            config_dict = {**LEGACY_DEFAULTS, **config_dict}
        return super().from_dict(config_dict, **kwargs)

    @property
    def cc_kernel_size(self) -> int:
        """Taps of the CC convolution along d_v (`ddl_cc_kernel_size`, None = d_v)."""
        return self.ddl_cc_kernel_size or self.ddl_value_channels

    def to_dict(self):
        output = super().to_dict()
        output.pop("ddl_implementation", None)  # (a runtime choice: a checkpoint must not pin another machine's)
        return output

    def validate_architecture(self):
        """Checked at construction (and by `config.validate()`): every DDL field, with what is allowed."""
        super().validate_architecture()

        def bad(field, allowed):
            return ValueError(f"DDLConfig.{field} must be {allowed}, got {getattr(self, field)!r}.")

        if self.ddl_value_channels < 1:
            raise bad("ddl_value_channels", "an integer >= 1 (1 = scalar state, 4 = the paper's default)")
        for field, choices in CHOICES.items():
            if getattr(self, field) not in choices:
                raise bad(field, f"one of {choices}")
        if self.ddl_cc_kernel_size is not None and not 1 <= self.ddl_cc_kernel_size <= self.ddl_value_channels:
            raise bad("ddl_cc_kernel_size", f"None (= d_v) or an integer in [1, d_v = {self.ddl_value_channels}]")
        if not 0 < self.ddl_init_std_factor < float("inf"):
            raise bad("ddl_init_std_factor", "a positive finite float (0.5 in the authors' code)")
        if not 0.0 <= self.ddl_beta_init <= 2.0:
            raise bad("ddl_beta_init", "in [0, 2] (0 = identity, 1 = projection, 2 = reflection)")
        for field in ("ddl_state_kernel_size", "ddl_embed_kernel_size"):
            if getattr(self, field) < 1:
                raise bad(field, "an integer >= 1 (1 = no token mixing)")
        if self.ddl_beta_hidden_size is not None and self.ddl_beta_hidden_size < 1:
            raise bad("ddl_beta_hidden_size", "None (single linear gate) or an integer >= 1")
        if not 0 < self.ddl_k_eps < float("inf"):
            raise bad("ddl_k_eps", "a positive finite float (1e-5 in the paper)")
        if self.ddl_v_sigmoid_scale is not None and not 0 < self.ddl_v_sigmoid_scale < float("inf"):
            raise bad("ddl_v_sigmoid_scale", "None (a linear value) or a positive finite float (4.0 in the paper)")
        if self.ddl_v_constant is not None and not abs(self.ddl_v_constant) < float("inf"):
            raise bad("ddl_v_constant", "None (a learned value) or a finite float (2.0 in the authors' option)")
        if self.ddl_embed_conv and self.ddl_value_channels == 1:
            raise bad("ddl_embed_conv", "False when ddl_value_channels == 1 (EC builds the d x d_v expanded state)")


__all__ = ["DDLConfig"]

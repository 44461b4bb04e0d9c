"""Deep Delta Learning (DDL) language model (Zhang, Liu, Wang, Gu, 2026, arXiv 2601.00417): Llama's architecture
with each residual addition of a decoder layer a delta update of the residual state. Attention, MLP, RMSNorm and
rotary embeddings are transformers' Llama modules (Llama's parameter names, attention backends and caches); the
defaults are the authors' (docs/faithfulness.md). Operations: specified in `ddl.reference`, run by `ddl.ops`."""

import math
import weakref
from contextlib import nullcontext
from dataclasses import dataclass, field, replace

import torch
import torch.nn.functional as F
from torch import nn
from transformers import AutoModel
from transformers import initialization as init
from transformers.cache_utils import Cache, DynamicCache, LinearAttentionCacheLayerMixin, StaticCache
from transformers.generation import GenerationMixin
from transformers.masking_utils import create_causal_mask, create_recurrent_attention_mask
from transformers.modeling_layers import GenericForQuestionAnswering, GenericForSequenceClassification
from transformers.modeling_layers import GenericForTokenClassification, GradientCheckpointingLayer
from transformers.modeling_outputs import BaseModelOutputWithPast, CausalLMOutputWithPast
from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS, PreTrainedModel, slice_logits_to_keep
from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES
from transformers.models.llama.modeling_llama import LlamaAttention, LlamaMLP, LlamaRMSNorm, LlamaRotaryEmbedding
from transformers.models.llama.modeling_llama import apply_rotary_pos_emb, eager_attention_forward
from transformers.utils.deprecation import deprecate_kwarg
from transformers.utils.generic import can_return_tuple, merge_with_config_defaults
from transformers.utils.output_capturing import OutputRecorder, capture_outputs

from .ops import choose, conv_step, delta_residual, folded_conv_read, kernel, token_conv, token_readout, window_step
from .configuration_ddl import DDLConfig, conv_state_slots
from .packing import Documents, Padding, check_documents_start, find_documents
from .reference import constant_value, delta_gate, delta_value


# beta = 2 sigmoid(b) can only reach 0 or 2 in the limit; the bias for beta_init in {0, 2} is clamped to this logit.
_MAX_GATE_LOGIT = 9.21


@dataclass
class BatchPlan:
    """What one forward's DDL operations need beside their tensors, made once by `DDLModel.forward`: the generation
    cache (token windows), padding and packed documents (`packing`), the implementation (`ops`), the state rebuild."""

    implementation: str
    cache: Cache | None = None
    padding: Padding | None = None
    documents: Documents | None = None
    rebuild: "StateRebuild | None" = None
    weights: dict = field(default_factory=dict)  # (this block's readout weights: each block's forward makes its own)
    call_weights: dict | None = None  # (one generate call's readout weights: its steps share them)

    def saving(self):
        """Where an operation saves the state: the rebuild's hooks, or autograd's (in a compiled region)."""
        return self.rebuild.hooks if self.rebuild is not None and not torch.compiler.is_compiling() else nullcontext()

    def readout_weight(self, compressor):
        """`compressor.derived_weight`, made once per block (each block's call and a checkpoint's recompute make their
        own) or generate call, but for a compressor whose pre-hooks may remake its weights."""
        kept = self.weights if self.call_weights is None else self.call_weights
        weights = {} if compressor._forward_pre_hooks else kept
        if compressor not in weights:
            weights[compressor] = compressor.derived_weight(self.implementation)
        return weights[compressor]


def cached_window(x, kernel_size, cache, layer_idx, slot, documents=None):
    """x's causal window as the cache holds it, time last: the K-1 inputs before x, then x, `(B, C, K-1+T)`; None at
    the start of a sequence. Stores x in conv-state `slot` of layer `layer_idx` (reorder, crop and static caches keep
    it right); of a packed batch, each row's last document only, after zeros."""
    if cache is None or kernel_size == 1:
        return None
    batch, seq_len = x.shape[:2]
    had_past = cache.has_previous_state(layer_idx, slot)
    flat = x.reshape(batch, seq_len, -1).transpose(1, 2)  # (B, C, T)
    if documents is not None:
        return _cached_window_of_documents(flat, kernel_size, cache, layer_idx, slot, had_past, documents)
    full = cache.update_conv_state(flat, layer_idx, state_idx=slot, conv_kernel_size=kernel_size - 1)
    if not had_past:
        return None
    width = kernel_size - 1 + seq_len
    window = full[..., -width:]
    return F.pad(window, (width - window.shape[-1], 0)) if window.shape[-1] < width else window


def _cached_window_of_documents(flat, kernel_size, cache, layer_idx, slot, had_past, documents):
    """`cached_window` of a packed batch: the cache keeps each row's last document (zeros before it)."""
    window = F.pad(flat, (kernel_size - 1, 0)) if not had_past else torch.cat(
        [cache.layers[layer_idx].conv_states[slot][..., -(kernel_size - 1) :].to(flat.dtype), flat], dim=-1)
    recorded = had_past and getattr(cache.layers[layer_idx], "record_past", False)  # (to crop: one input a token)
    cache.update_conv_state(documents.last_document(window)[..., kernel_size - 1 if recorded else 0 :], layer_idx,
                            state_idx=slot, conv_kernel_size=kernel_size - 1)
    return window if had_past else None


def steppable_window(cache, layer_idx, slot, kernel_size):
    """The K-1 inputs before a decoding step's token `(B, C, K-1)` where the cache keeps them, for its step
    (`ops.window_step`, `ops.conv_step`) to advance in place; None where it keeps none or all (assisted decoding)."""
    if cache is None or kernel_size == 1 or not cache.has_previous_state(layer_idx, slot):
        return None
    past = None if getattr(cache.layers[layer_idx], "record_past", True) else cache.layers[layer_idx].conv_states[slot]
    return past if past is not None and past.shape[-1] == kernel_size - 1 and past.is_contiguous() else None


def window_history(window, x):
    """The inputs before x in a cached window `(B, C, K-1+T)`, in x's layout `(B, K-1, ...)`; None stays None."""
    past = None if window is None else window[..., : window.shape[-1] - x.shape[1]]
    return None if past is None else past.transpose(1, 2).reshape(x.shape[0], past.shape[-1], *x.shape[2:])


def convolve_tokens(op, x, weight, plan, layer_idx=0, slot=None):
    """`op(x, weight, history, implementation)` (EC's `token_conv`, TC's `token_readout`) with the cache's
    history, padding zeroed or compacted (`packing.Padding`), a packed batch's documents apart (`packing.Documents`)."""
    kernel, cache, padding, documents = weight.shape[0], plan.cache, plan.padding, plan.documents
    implementation = plan.implementation
    if padding is not None:
        x = padding.masked(x)
        if padding.compacts and kernel > 1:
            x, window = padding.compact(x, kernel, cache, layer_idx, slot)
            return padding.restore(op(x, weight, window_history(window, x), implementation), kernel)
    if x.shape[1] == 1 and documents is None and not torch.is_grad_enabled():
        past = steppable_window(cache, layer_idx, slot, kernel)
        if past is not None:  # a decoding step: read and advanced where the cache keeps it
            return (window_step if op is token_readout else conv_step)(past, x, weight, implementation)
    window = cached_window(x, kernel, cache, layer_idx, slot, documents)
    history = window_history(window, x)
    if documents is not None:
        return documents.convolve(op, x, weight, history, implementation)
    return op(x, weight, history, implementation)


class StateRebuild:
    r"""The expanded states of one training forward, rebuilt in backward instead of kept (`ddl_rebuild_states`).

    Every update writes along h: X_{l+1} = X_l + h (x) w, w = h^T (X_{l+1} - X_l) / |h|^2, so X_l = X_{l+1} - h (x) w.
    Under `hooks`, a saved tensor that *is* the live state is saved as its place and rebuilt in backward. The chain
    stops where an update reads another tensor (a recompute) and raises on a state changed in place; it is made only
    where no code outside ddl sees a state (`DDLModel._rebuilds`): a state edited through `.data` (which autograd does
    not see) would rebuild the wrong ones. One rounding per update: fp32/fp64. Only detached tensors are held (no
    cycle through autograd's graph). Inside the operations it wraps, `hooks` takes over from a caller's own."""

    def __init__(self, x0):
        chain = weakref.ref(self)  # (a bound method would be a cycle: the chain and its last state kept until gc)
        pack, unpack = lambda t: chain()._pack(t), lambda s: s[0]._unpack(*s[1:]) if isinstance(s, tuple) else s
        self.hooks = torch.autograd.graph.saved_tensors_hooks(pack, unpack)
        self.states, self.versions, self.writes, self.live = [x0.detach()], [x0._version], [], weakref.ref(x0)
        self.buffer, self.held = None, None  # (backward's rebuilt state, and which one it holds)

    def push(self, x, x_next, h):
        """Records the update x -> x_next, written along h, and lets go of x (if x is the live state)."""
        if self.live is None or x is not self.live():
            self.live = None  # (the chain stops: the states from here on are kept by autograd)
            return
        self._check(len(self.states) - 1)
        with torch.no_grad(), torch.autocast(x.device.type, enabled=False):
            h = h.detach().to(x.dtype).unsqueeze(-2)  # (B, T, 1, d)
            w = ((h @ x_next.transpose(-1, -2)) - (h @ x.transpose(-1, -2))).squeeze(-2)  # h^T (X_next - X)
            w = w / h.squeeze(-2).square().sum(-1, keepdim=True).clamp_min(1e-30)
        self.writes.append((h.squeeze(-2), w))
        self.states[-1:], self.live = [None, x_next.detach()], weakref.ref(x_next)
        self.versions.append(x_next._version)

    def end(self):
        """No state after this one: a recompute in backward (torch's checkpoint) keeps its states."""
        self.live = None

    def _pack(self, tensor):
        """The live state, or a view of it (as the specifications' operations save it), as its place and view."""
        live = self.live() if self.live is not None else None
        if live is None or not live.is_contiguous() or tensor.dtype != live.dtype or (
                tensor.untyped_storage().data_ptr() != live.untyped_storage().data_ptr()):
            return tensor
        return self, len(self.states) - 1, tensor.shape, tensor.stride(), tensor.storage_offset() - live.storage_offset()

    def _unpack(self, index, shape, stride, offset):
        return self.state(index).as_strided(shape, stride, offset)

    def _check(self, index):
        if self.states[index]._version != self.versions[index]:
            raise RuntimeError("DDL: an expanded state was changed in place after its update, so backward cannot "
                               "rebuild the states before it; set model.config.ddl_rebuild_states = False.")

    def state(self, index):
        """X_index: the last state as the forward left it, or rebuilt downwards in the chain's one buffer, in place
        (backward asks for the states in reverse; a second backward starts from the last state again)."""
        if torch.is_grad_enabled():
            raise RuntimeError("DDL: a second derivative (create_graph=True) through states rebuilt in backward is not "
                               "supported; set model.config.ddl_rebuild_states = False.")
        top = len(self.states) - 1
        self._check(top)
        if index == top:
            return self.states[top]
        if self.held is None or self.held < index:  # (from the last state, into the buffer: no copy of it first)
            h, w = self.writes[top - 1]
            self.buffer = torch.addcmul(self.states[top], h.unsqueeze(-2), w.unsqueeze(-1), value=-1.0, out=self.buffer)
            self.held = top - 1
        for h, w in reversed(self.writes[index:self.held]):
            self.buffer.addcmul_(h.unsqueeze(-2), w.unsqueeze(-1), value=-1.0)
        self.held = index
        return self.buffer


# Hooks of the libraries that wrap a model (transformers' output capture, FSDP, DeepSpeed, accelerate) read, gather or
# move tensors; any other forward hook is user code, which may see a state and edit it in place.
_LIBRARIES = ("torch.", "transformers.", "accelerate.", "deepspeed.")


def user_hooks(module):
    """Whether user code hooks `module`'s forward (its own hooks, or every module's)."""
    every = torch.nn.modules.module
    if every._global_forward_hooks or every._global_forward_pre_hooks:
        return True
    hooks = (*module._forward_hooks.values(), *module._forward_pre_hooks.values())
    return any(not getattr(hook, "__module__", "").startswith(_LIBRARIES) for hook in hooks)


def unseen(module, device):
    """A kernel may do `module`'s work in another's pass: no hook of any kind on it or every module, weights here."""
    every = torch.nn.modules.module
    hooks = (module._forward_hooks, module._forward_pre_hooks, module._backward_hooks, module._backward_pre_hooks,
             every._global_backward_hooks, every._global_backward_pre_hooks)
    return not any(hooks) and not user_hooks(module) and all(p.device == device for p in module.parameters())


class DDLDeltaResidual(nn.Module):
    r"""One sublayer's residual seam: the gate beta, the target v, and the delta update (`reference.delta_residual`).

        beta = 2 sigmoid(w . c + b)                 (fp32; or w2 . tanh(W1 c [+ b1]) + b2 with ddl_beta_hidden_size)
        v    = s sigmoid(W_v u + b_v)   in (0, s)   (or W_v u + b_v when ddl_v_sigmoid_scale is None; or the
                                                     constant ddl_v_constant, with no value projection)
        X   <- X + beta k (v^T - k^T X),  k = h / sqrt(|h|^2 + eps^2)

    c is the normalised sublayer input, u the value input (`ddl_value_input`: x_in or c); `additive` computes X + h."""

    def __init__(self, config: DDLConfig):
        super().__init__()
        self.config, self.mode = config, config.ddl_residual
        self.value_from_state = config.ddl_value_input == "state"
        self.v_scale, self.k_eps, self.v_constant = config.ddl_v_sigmoid_scale, config.ddl_k_eps, config.ddl_v_constant
        d, dv, hb = config.hidden_size, config.ddl_value_channels, config.ddl_beta_hidden_size
        self.gate_is_mlp = hb is not None and self.mode != "additive"
        if self.mode == "additive":  # (X + h: no gate, no value)
            return
        if hb is not None:
            self.beta_hidden_weight = nn.Parameter(torch.empty(hb, d))
            self.beta_hidden_bias = nn.Parameter(torch.empty(hb)) if config.ddl_beta_hidden_bias else None
        self.beta_weight = nn.Parameter(torch.empty(d if hb is None else hb))
        self.beta_bias = nn.Parameter(torch.empty(1))
        if config.ddl_v_constant is None:
            self.value_weight = nn.Parameter(torch.empty(dv, d))
            self.value_bias = nn.Parameter(torch.empty(dv))

    def forward(self, state, h, context, x_in, plan, read_next=None, slot=None, norm=None, read=None):
        """(X_next, the next sublayer's input[, its `norm` or None]) for the state X, the sublayer output h, its
        normalised input c (`context`) and input x_in (`read`'s kernel's readout of X, untouched since): the next input
        is `read_next`'s readout of X_next (its cache `slot`) or X_next; a kernel makes it (and a norm) in the pass."""
        readout = plan.readout_weight(read_next) if read_next is not None and self.mode != "additive" and (
            read_next.fusable("delta_residual_readout", plan, slot, state.device) and not user_hooks(self)) else None
        fuse = type(norm) is LlamaRMSNorm and kernel("delta_residual_readout_norm", plan.implementation, h.device) and (
            readout is not None or read_next is None and not user_hooks(self)) and unseen(norm, state.device)
        u_read = plan.readout_weight(read) if read and self.value_from_state and not user_hooks(self) else None
        weights = [getattr(self, name, None) for name in ("beta_weight", "beta_bias", "value_weight", "value_bias")]
        with plan.saving():
            out = delta_residual(state, h, context, x_in if self.value_from_state else context, *weights,
                                 v_scale=self.v_scale, k_eps=self.k_eps, mode=self.mode,
                                 gate_hidden=self._gate_hidden(), v_constant=self.v_constant, readout=readout,
                                 norm=(norm.weight, norm.variance_epsilon) if fuse else None, u_read=u_read,
                                 implementation=plan.implementation)
        out, made, normed = out if fuse else (out, None, None) if readout is None else (*out, None)
        if made is not None:  # (TC's window, read from zeros, for the next tokens; CC has none)
            cached_window(out, readout.shape[0], plan.cache, read_next.layer_idx, slot)
        if plan.rebuild is not None and not torch.compiler.is_compiling():  # (a compiled region: the chain stops)
            plan.rebuild.push(state, out, h)
        if read_next is not None and made is None:  # (TC, or no kernel: the compressor reads, with the norm if it may)
            made, normed = read_next.read_normed(out, plan, slot, norm, self)
        return (out, out if read_next is None else made) + (() if norm is None else (normed,))

    def _gate_hidden(self):
        return (self.beta_hidden_weight, self.beta_hidden_bias) if self.gate_is_mlp else None

    def gate(self, context):
        """beta `(B, T, 1)` (fp32) for normalised sublayer inputs c, as the forward computes it (for probing)."""
        return delta_gate(context, self.beta_weight, self.beta_bias, *(self._gate_hidden() or ()))

    def value(self, u, state=None):
        """v `(B, T, d_v)` for value inputs u, as the forward computes it (probing; a constant: the state's shape)."""
        if self.v_constant is not None:
            return constant_value(state, self.v_constant)
        return delta_value(u, self.value_weight, self.value_bias, self.v_scale)


class DDLCompressor(nn.Module):
    r"""Compress the expanded state X `(B, T, d_v, d)` to a width-d vector (a sublayer input or the final readout).

        CC, conv (the authors'):  y[i, o] = sum_m c[i, m] X[o + m - p, i]   (along d_v: K taps, "same" zero
                                  padding, p = (K-1) // 2),  x_in[i] = sum_o r_o y[i, o]
        CC, matrix:               x_in[i] = sum_j w[i, j] X[j, i]
        TC:                       x_in[t, i] = sum_j r_j sum_s c[s, i, j] X[t - (K-1) + s, j, i]   (causal, tokens)

    CC: `reference.causal_token_readout` with one tap, TC its K-tap case. A shared compressor gets each call's slot."""

    def __init__(self, config: DDLConfig, layer_idx: int):
        super().__init__()
        self.config, self.layer_idx = config, layer_idx
        self.kind = config.ddl_compressor if config.ddl_compressor == "tc" else f"cc_{config.ddl_cc_form}"
        d, dv = config.hidden_size, config.ddl_value_channels
        if self.kind == "cc_matrix":
            self.weight = nn.Parameter(torch.empty(d, dv))
            return
        kernel = config.ddl_state_kernel_size if self.kind == "tc" else config.cc_kernel_size
        self.conv_weight = nn.Parameter(torch.empty(kernel, d, dv) if self.kind == "tc" else torch.empty(d, kernel))
        self.read = nn.Parameter(torch.empty(dv))

    def derived_weight(self, implementation):
        """The readout's weight `(K, d, d_v)`, with autograd: CC's (K = 1: the matrix, or the conv and read vector
        folded, `ops.folded_conv_read` run by `implementation`), or TC's taps times the read vector."""
        if self.kind == "tc":
            return self.conv_weight * self.read
        cc = self.weight if self.kind == "cc_matrix" else folded_conv_read(self.conv_weight, self.read, implementation)
        return cc.unsqueeze(0)

    def fusable(self, op, plan, slot, device):
        """Whether kernel `op` (the seam's, or one with the norm) may make this readout: it is there, this is `unseen`,
        no token before (CC; TC without padding, documents or `slot`'s cached window, which a step's kernel reads)."""
        return (kernel(op, plan.implementation, device) is not None and unseen(self, device) and (
            self.kind != "tc" or plan.padding is plan.documents is None and (op == "window_step_norm" or (
                plan.cache is None or not plan.cache.has_previous_state(self.layer_idx, slot)))))

    def read_normed(self, state, plan, slot, norm=None, seam=None):
        """(x_in, `norm`(x_in)) where one kernel makes both (`fusable`, a LlamaRMSNorm `unseen`, no user hook on the
        calling `seam`, which may edit x_in before the norm reads it), else (x_in, None)."""
        past = steppable_window(plan.cache, self.layer_idx, slot, self.config.ddl_state_kernel_size) if (
            self.kind == "tc" and state.shape[1] == 1 and not torch.is_grad_enabled()) else None  # (a decoding step's)
        op = "token_readout_norm" if past is None else "window_step_norm"
        if type(norm) is LlamaRMSNorm and self.fusable(op, plan, slot, state.device) and unseen(
                norm, state.device) and (seam is None or not user_hooks(seam)):  # (a call may bring its weights)
            weight, gain = plan.readout_weight(self), (norm.weight, norm.variance_epsilon)
            with plan.saving():
                made = window_step(past, state, weight, plan.implementation, norm=gain) if past is not None else (
                    token_readout(state, weight, implementation=plan.implementation, norm=gain))
            if made is not None:  # (TC, not a step: the window it read from zeros, kept for the next tokens)
                cached_window(state, weight.shape[0], plan.cache if past is None else None, self.layer_idx, slot)
                return made
        return self(state, plan, slot), None

    def forward(self, state, plan=None, slot=None):
        """x_in `(B, T, d)`: the readout of the state (TC: over the tokens, with the cache's window in `slot`)."""
        plan = plan or BatchPlan(choose(self.config.ddl_implementation))
        weight = plan.readout_weight(self)  # (K, d, d_v)
        with plan.saving():
            if self.kind != "tc":
                return token_readout(state, weight, implementation=plan.implementation)
            return convolve_tokens(token_readout, state, weight, plan, self.layer_idx, slot)


class DDLEmbedConv(nn.Module):
    """EC: the d x d_v initial state from a causal depthwise conv of the token embeddings (identity at init)."""

    def __init__(self, config: DDLConfig, cache_slot: int | None):
        super().__init__()
        self.config, self.cache_slot = config, cache_slot
        self.weight = nn.Parameter(torch.empty(config.ddl_embed_kernel_size, config.hidden_size,
                                               config.ddl_value_channels))

    def forward(self, embeds, plan=None):
        plan = plan or BatchPlan(choose(self.config.ddl_implementation))
        return convolve_tokens(token_conv, embeds, self.weight, plan, 0, self.cache_slot)  # (B, T, d_v, d)


class DDLQKNormAttention(LlamaAttention):
    """Llama's attention with an RMSNorm over each query and key head (`q_norm`, `k_norm`, Qwen3's names), after the
    rotary embedding (`qk_norm_position="after_rope"`, the authors') or before it (Qwen3's)."""

    def __init__(self, config: DDLConfig, layer_idx: int):
        super().__init__(config, layer_idx)
        self.q_norm = LlamaRMSNorm(self.head_dim, eps=config.rms_norm_eps)
        self.k_norm = LlamaRMSNorm(self.head_dim, eps=config.rms_norm_eps)
        self.norm_after_rope = config.qk_norm_position == "after_rope"

    def forward(self, hidden_states, position_embeddings=None, attention_mask=None, cache=None, **kwargs):
        input_shape = hidden_states.shape[:-1]
        hidden_shape = (*input_shape, -1, self.head_dim)
        query_states = self.q_proj(hidden_states).view(hidden_shape).transpose(1, 2)
        key_states = self.k_proj(hidden_states).view(hidden_shape).transpose(1, 2)
        value_states = self.v_proj(hidden_states).view(hidden_shape).transpose(1, 2)
        if not self.norm_after_rope:
            query_states, key_states = self.q_norm(query_states), self.k_norm(key_states)
        query_states, key_states = apply_rotary_pos_emb(query_states, key_states, *position_embeddings)
        if self.norm_after_rope:
            query_states, key_states = self.q_norm(query_states), self.k_norm(key_states)
        if cache is not None:
            key_states, value_states = cache.update(key_states, value_states, self.layer_idx, kwargs=kwargs)
        attention_interface = ALL_ATTENTION_FUNCTIONS.get_interface(self.config._attn_implementation,
                                                                    eager_attention_forward)
        attn_output, attn_weights = attention_interface(self, query_states, key_states, value_states, attention_mask,
                                                        dropout=0.0 if not self.training else self.attention_dropout,
                                                        scaling=self.scaling, **kwargs)
        return self.o_proj(attn_output.reshape(*input_shape, -1).contiguous()), attn_weights


class DDLDecoderLayer(GradientCheckpointingLayer):
    """Llama's decoder layer; its two `residual + h` lines are delta updates of the state X (`DDLDeltaResidual`),
    each of which also gives the next sublayer's input."""

    def __init__(self, config: DDLConfig, layer_idx: int):
        super().__init__()
        self.config, self.hidden_size = config, config.hidden_size
        attention_class = DDLQKNormAttention if config.qk_norm else LlamaAttention
        self.self_attn = attention_class(config=config, layer_idx=layer_idx)
        self.mlp = LlamaMLP(config)
        self.input_layernorm = LlamaRMSNorm(config.hidden_size, eps=config.rms_norm_eps)
        self.post_attention_layernorm = LlamaRMSNorm(config.hidden_size, eps=config.rms_norm_eps)
        self.attn_delta = DDLDeltaResidual(config)
        self.mlp_delta = DDLDeltaResidual(config)
        # The authors' initialisation divides these by the depth (they write into the residual state).
        self.self_attn.o_proj.ddl_residual_output = self.mlp.down_proj.ddl_residual_output = True
        slots = conv_state_slots(config)
        self.cache_slots = {which: slots.get((layer_idx, which)) for which in ("attn", "mlp")}
        if config.ddl_value_channels > 1:
            if config.ddl_shared_compressor:
                self.compress = DDLCompressor(config, layer_idx)  # one per block, as in the authors' code
            else:
                self.attn_compress = DDLCompressor(config, layer_idx)
                self.mlp_compress = DDLCompressor(config, layer_idx)

    @deprecate_kwarg("past_key_values", "5.40.0", new_name="cache")
    def forward(self, hidden_states, attention_mask=None, position_ids=None, cache: Cache | None = None,
                use_cache: bool | None = False, position_embeddings=None, plan: BatchPlan | None = None, **kwargs):
        plan = replace(plan, weights={}) if plan else BatchPlan(choose(self.config.ddl_implementation), cache)
        modules = self._modules  # (the compressor of each sublayer, None at d_v = 1: no missing-attribute exception)
        read_attn, read_mlp = (modules.get("compress") or modules.get(f"{which}_compress") for which in ("attn", "mlp"))
        # Self Attention: on the state's readout x_in (the state itself at d_v = 1)
        x_in, context = (hidden_states, None) if read_attn is None else read_attn.read_normed(
            hidden_states, plan, self.cache_slots["attn"], self.input_layernorm)
        context = self.input_layernorm(x_in) if context is None else context  # (or the readout's kernel made it)
        h, _ = self.self_attn(hidden_states=context, attention_mask=attention_mask, position_ids=position_ids,
                              cache=cache, use_cache=use_cache, position_embeddings=position_embeddings, **kwargs)
        hidden_states, x_in, made = self.attn_delta(hidden_states, h, context, x_in, plan, read_mlp,
                                                    self.cache_slots["mlp"], self.post_attention_layernorm)
        context = self.post_attention_layernorm(x_in) if made is None else made  # (or a kernel made it with x_in)
        hidden_states, _ = self.mlp_delta(hidden_states, self.mlp(context), context, x_in, plan, read=read_mlp if (
            made is not None and torch.is_grad_enabled()) else None)  # (x_in as a kernel read it: backward may again)
        return hidden_states


class DDLStateReadout(nn.Module):
    r"""What `output_hidden_states` records after each block: the state read through the final readout `(B, T, d)`
    (no cache: full forwards, not decoding steps), and the first call's first argument (the embeddings) as entry 0."""

    def forward(self, embeds, state, readout=None, plan=None):
        return state if state.dim() == 3 else readout(state, replace(plan, cache=None))


@dataclass
class DDLModelOutputWithPast(BaseModelOutputWithPast):
    r"""
    expanded_states (`tuple(torch.FloatTensor)`, *optional*, returned when `output_expanded_states=True`):
        The full DDL state after every block, unread, `(B, T, d_v, d)` (`(B, T, d)` when d_v = 1), from `DDLModel`
        (`model.model(...)` under a head); `hidden_states` holds their `(B, T, d)` readouts."""

    expanded_states: tuple[torch.FloatTensor, ...] | None = None


class DDLPreTrainedModel(PreTrainedModel):
    config_class = DDLConfig
    config: DDLConfig
    base_model_prefix = "model"
    supports_gradient_checkpointing = True
    _no_split_modules = ["DDLDecoderLayer"]
    _supports_flash_attn = True
    _supports_sdpa = True
    _supports_flex_attn = True
    _supports_attention_backend = True
    _can_compile_fullgraph = True
    _can_record_outputs = {  # (what each records: DDLStateReadout, DDLModelOutputWithPast)
        "hidden_states": DDLStateReadout, "expanded_states": DDLDecoderLayer,
        "attentions": OutputRecorder(LlamaAttention, index=1)}

    @torch.no_grad()
    def _init_weights(self, module):
        """All initialisation lives here, so it also runs for `from_pretrained` (missing keys) and meta-device init.
        `ddl_initialization` chooses the authors' spectral scheme or transformers' (see DDLConfig)."""
        config = self.config
        authors = config.ddl_initialization == "authors"
        if authors and isinstance(module, nn.Linear):
            init.normal_(module.weight, mean=0.0, std=_authors_std(module.weight, config, module))
            if module.bias is not None:
                init.zeros_(module.bias)
        else:
            super()._init_weights(module)
        if isinstance(module, DDLDeltaResidual) and module.mode != "additive":
            _init_delta_residual(module, config, authors)
        elif isinstance(module, DDLCompressor):
            dv = config.ddl_value_channels
            if module.kind == "cc_matrix":
                init.constant_(module.weight, 1.0 / dv)  # the average of the d_v channels
                return
            if module.kind == "tc" and not authors:
                init.copy_(module.conv_weight, _identity_taps(module.conv_weight))
            else:  # the authors' neutral start: every tap 1/K (TC: the average of the last K tokens)
                init.constant_(module.conv_weight, 1.0 / module.conv_weight.shape[0 if module.kind == "tc" else 1])
            init.constant_(module.read, 1.0 / dv)
        elif isinstance(module, DDLEmbedConv):
            init.copy_(module.weight, _identity_taps(module.weight))  # every channel starts as the embedding


def _spectral_std(fan_in, fan_out, factor):
    """The authors' spectral scale: factor / sqrt(fan_in) * min(1, sqrt(fan_out / fan_in))."""
    return factor / math.sqrt(fan_in) * min(1.0, math.sqrt(fan_out / fan_in))


def _authors_std(weight, config, module=None):
    """The authors' std of a matrix `(fan_out, fan_in)`: spectral, divided by the depth for the projections into the
    state; an LM head is drawn like the embeddings."""
    if getattr(module, "ddl_lm_head", False):
        return config.initializer_range
    std = _spectral_std(weight[0].numel(), weight.shape[0], config.ddl_init_std_factor)
    return std / config.num_hidden_layers if getattr(module, "ddl_residual_output", False) else std


def _init_delta_residual(module, config, authors):
    """The gate starts at beta_init (bias logit(beta_init / 2)); the rest per `ddl_initialization`."""
    half = min(max(config.ddl_beta_init / 2.0, 0.0), 1.0)
    logit = math.log(half / (1.0 - half)) if 0.0 < half < 1.0 else math.copysign(_MAX_GATE_LOGIT, half - 0.5)
    init.constant_(module.beta_bias, max(min(logit, _MAX_GATE_LOGIT), -_MAX_GATE_LOGIT))
    factor, d = config.ddl_init_std_factor, config.hidden_size
    hidden = getattr(module, "beta_hidden_weight", None)
    if hidden is not None:
        std = _spectral_std(d, hidden.shape[0], factor) if authors else config.initializer_range
        init.normal_(hidden, mean=0.0, std=std)
        if module.beta_hidden_bias is not None:
            init.zeros_(module.beta_hidden_bias)
    if authors:  # the gate vector is the authors' (1, fan_in) matrix
        init.normal_(module.beta_weight, mean=0.0, std=_spectral_std(module.beta_weight.shape[0], 1, factor))
    else:
        init.zeros_(module.beta_weight)  # every token starts at exactly beta_init
    if hasattr(module, "value_weight"):
        if authors:  # spectral weight; the bias as nn.Linear's default, U(-1/sqrt(d), 1/sqrt(d))
            init.normal_(module.value_weight, mean=0.0, std=_spectral_std(d, module.value_weight.shape[0], factor))
            init.uniform_(module.value_bias, -1.0 / math.sqrt(d), 1.0 / math.sqrt(d))
        else:
            init.normal_(module.value_weight, mean=0.0, std=config.initializer_range)
            init.zeros_(module.value_bias)


def _identity_taps(weight):
    """Conv taps that pass the current token through unchanged: 1 at tap K-1, 0 elsewhere."""
    taps = torch.zeros_like(weight)
    taps[-1] = 1.0
    return taps


class DDLModel(DDLPreTrainedModel):
    def __init__(self, config: DDLConfig):
        super().__init__(config)
        config.validate_architecture()  # (fields set after construction are checked here, before they are used)
        self.padding_idx = config.pad_token_id
        self.vocab_size = config.vocab_size
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size, self.padding_idx)
        slots = conv_state_slots(config)
        self.keeps_token_histories = bool(slots)  # (EC, TC: the cache keeps their inputs)
        if config.ddl_embed_conv:
            self.embed_conv = DDLEmbedConv(config, slots.get((0, "embed")))
        self.layers = nn.ModuleList([DDLDecoderLayer(config, i) for i in range(config.num_hidden_layers)])
        if config.ddl_value_channels > 1:
            last = config.num_hidden_layers - 1
            self.readout = DDLCompressor(config, last)
            self.readout_slot = slots.get((last, "readout"))
        self.norm = LlamaRMSNorm(config.hidden_size, eps=config.rms_norm_eps)
        self.rotary_emb = LlamaRotaryEmbedding(config=config)
        self.state_readout = DDLStateReadout()  # (no parameters: it reads through self.readout)
        self.gradient_checkpointing = False
        self.post_init()

    def expand(self, embeds, plan):
        """The initial state X_0: the embeddings (d_v = 1), EC of them, or them repeated over the d_v channels; in
        autocast's dtype under autocast with `ddl_autocast_state`."""
        d_v, device = self.config.ddl_value_channels, embeds.device.type
        repeated = embeds if d_v == 1 else embeds.unsqueeze(-2).expand(*embeds.shape[:2], d_v, embeds.shape[-1])
        state = self.embed_conv(embeds, plan) if self.config.ddl_embed_conv else repeated
        autocast = self.config.ddl_autocast_state and torch.is_autocast_enabled(device)
        return state.to(torch.get_autocast_dtype(device)) if autocast else state

    def _check_cache(self, cache):
        if self.keeps_token_histories and not isinstance((cache.layers or [0])[0], LinearAttentionCacheLayerMixin):
            raise ValueError("This DDL variant keeps token-convolution histories, which a bare `DynamicCache()` cannot "
                             "hold: pass `DynamicCache(config=model.config)` (or let `generate()` build the cache).")

    def _rebuilds(self, state, kwargs):
        """Whether backward rebuilds the expanded states instead of keeping them (`StateRebuild`): in training, fp32 or
        fp64, with `ddl_rebuild_states`, where no block is recomputed (gradient checkpointing) or traced, no state is
        handed out (`output_expanded_states`) and no user code sees one (a forward hook on a block or DDL's modules)."""
        if not (self.config.ddl_rebuild_states and state.dim() == 4 and torch.is_grad_enabled()
                and state.dtype in (torch.float32, torch.float64) and not self.gradient_checkpointing
                and not torch.compiler.is_compiling()
                and not kwargs.get("output_expanded_states", getattr(self.config, "output_expanded_states", False))):
            return False
        seen = [self, self.state_readout, *self.layers, getattr(self, "embed_conv", None), getattr(self, "readout", None)]
        seen += [module for layer in self.layers for module in layer.children() if isinstance(
            module, (DDLDeltaResidual, DDLCompressor))]
        return not any(user_hooks(module) for module in seen if module is not None)

    @staticmethod
    def _count_positions(attention_mask, pad_mask, cache, embeds):
        """A padded row's positions count its real tokens (as generate's: QK-norm after RoPE is not shift-invariant); an
        unpadded batch (no pad_mask) shares one row, as Llama's; a decoding step counts: one token per row is cheap."""
        seen, length = (cache.get_seq_length() if cache is not None else 0), embeds.shape[1]
        plain = lambda: (torch.arange(length, device=embeds.device) + seen).unsqueeze(0)  # noqa: E731
        if (pad_mask is None and length > 1) or getattr(attention_mask, "ndim", 0) != 2:
            return plain()
        counted = (attention_mask.long().cumsum(-1) - 1).clamp_min(0)[:, -length:]
        spans = attention_mask.shape[1] == seen + length  # (the mask covers the cache's tokens and these)
        return torch.where(spans, counted, plain()) if torch.is_tensor(spans) else counted if spans else plain()

    @staticmethod
    def _find_documents(inputs_embeds, attention_mask, pad_mask, position_ids, cache, cu_seq_lens_q):
        """The documents of a packed batch (`packing.find_documents`: no padding, and position ids restarting inside a
        row, or `cu_seq_lens_q`), and, where transformers' causal mask would not keep them apart (it looks for packing
        only without a mask and a cache), the mask function that does; (None, None) for any other batch."""
        if (position_ids is None and cu_seq_lens_q is None) or pad_mask is not None or (
                attention_mask is not None and attention_mask.dim() != 2):
            return None, None
        documents = find_documents(*inputs_embeds.shape[:2], position_ids, cu_seq_lens_q)
        if documents is None or getattr(cache, "is_compileable", False) or (  # (a static cache's masks span it all)
                attention_mask is None and cache is None and position_ids is not None):
            return documents, None
        return documents, documents.attention_mask_function(cache.get_seq_length() if cache is not None else 0)

    @deprecate_kwarg("past_key_values", "5.40.0", new_name="cache")
    @merge_with_config_defaults
    @capture_outputs
    def forward(self, input_ids=None, attention_mask=None, position_ids=None, cache: Cache | None = None,
                inputs_embeds=None, use_cache: bool | None = None, **kwargs) -> DDLModelOutputWithPast:
        if (input_ids is None) ^ (inputs_embeds is not None):
            raise ValueError("You must specify exactly one of input_ids or inputs_embeds")
        name, given, dims, shape = (("input_ids", input_ids, 2, "(batch, sequence)") if input_ids is not None else
                                    ("inputs_embeds", inputs_embeds, 3, "(batch, sequence, hidden)"))
        if given.dim() != dims:
            raise ValueError(f"DDL: {name} must be {shape}, got shape {tuple(given.shape)}; a single sequence needs a "
                             f"batch dimension: {name}.unsqueeze(0).")
        if inputs_embeds is None:
            inputs_embeds = self.embed_tokens(input_ids)
        if use_cache and cache is None:
            cache = DynamicCache(config=self.config)
        if cache is not None:
            self._check_cache(cache)
        pad_mask = attention_mask.get("linear_attention") if isinstance(attention_mask, dict) else (  # (dict: built
            create_recurrent_attention_mask(self.config, inputs_embeds, attention_mask, cache))  # by generate, static)
        positions = position_ids if position_ids is not None else self._count_positions(
            attention_mask, pad_mask, cache, inputs_embeds)
        documents, causal_mask = None, attention_mask["full_attention"] if isinstance(attention_mask, dict) else None
        if not isinstance(attention_mask, dict):
            documents, packed_attention = self._find_documents(
                inputs_embeds, attention_mask, pad_mask, position_ids, cache, kwargs.get("cu_seq_lens_q"))
            if position_ids is not None and pad_mask is None and self.keeps_token_histories and (  # (a static cache's
                    cache is None or torch.compiler.is_compiling() or cache.get_seq_length() == 0):  # count: a tensor)
                check_documents_start(position_ids)
            causal_mask = create_causal_mask(config=self.config, inputs_embeds=inputs_embeds,
                                             attention_mask=attention_mask, cache=cache, position_ids=positions,
                                             and_mask_function=packed_attention)
        padding = Padding.of(pad_mask, inputs_embeds.dtype, cache)
        kept = kwargs.pop("ddl_readout_weights", None)  # (generate's; never kept under autograd or in a trace)
        plan = BatchPlan(choose(self.config.ddl_implementation), cache, padding, documents, call_weights=None if (
            torch.is_grad_enabled() or torch.compiler.is_compiling()) else kept)
        position_embeddings = self.rotary_emb(inputs_embeds, position_ids=positions)

        hidden_states = self.expand(inputs_embeds, plan)  # X_0: (B, T, [d_v,] d)
        plan.rebuild = StateRebuild(hidden_states) if self._rebuilds(hidden_states, kwargs) else None
        record = kwargs.get("output_hidden_states", self.config.output_hidden_states)
        readout = getattr(self, "readout", None)
        for i, decoder_layer in enumerate(self.layers[: self.config.num_hidden_layers]):
            hidden_states = decoder_layer(hidden_states, attention_mask=causal_mask,
                                          position_embeddings=position_embeddings, position_ids=positions,
                                          cache=cache, use_cache=use_cache, plan=plan, **kwargs)
            if record:
                self.state_readout(inputs_embeds if i == 0 else None, hidden_states, readout, plan)
        hidden_states, normed = (hidden_states, None) if readout is None else readout.read_normed(  # (B, T, d)
            hidden_states, plan, self.readout_slot, self.norm)
        if plan.rebuild is not None:
            plan.rebuild.end()
        hidden_states = self.norm(hidden_states) if normed is None else normed
        return DDLModelOutputWithPast(last_hidden_state=hidden_states, cache=cache)


class DDLForCausalLM(DDLPreTrainedModel, GenerationMixin):
    _tied_weights_keys = {"lm_head.weight": "model.embed_tokens.weight"}
    _tp_plan = {"lm_head": "colwise_gather_output"}
    _pp_plan = {"lm_head": (["hidden_states"], ["logits"])}

    def __init__(self, config: DDLConfig):
        super().__init__(config)
        self.model = DDLModel(config)
        self.vocab_size = config.vocab_size
        self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)
        self.lm_head.ddl_lm_head = True  # initialised like the embeddings (it is them, when tied)
        self.post_init()

    @deprecate_kwarg("past_key_values", "5.40.0", new_name="cache")
    @can_return_tuple
    def forward(self, input_ids=None, attention_mask=None, position_ids=None, cache: Cache | None = None,
                inputs_embeds=None, labels=None, use_cache: bool | None = None, logits_to_keep: int | torch.Tensor = 0,
                ddl_readout_weights: dict | None = None, **kwargs) -> CausalLMOutputWithPast:
        """Causal LM forward. `labels` are the input ids (shifted inside; -100 is ignored); extra loss kwargs such
        as `num_items_in_batch` (passed by `Trainer`) go to the loss. `ddl_readout_weights`: generate's, a new dict per
        call in which its steps share the compressors' readout weights (unused with autograd; kept, it goes stale)."""
        outputs: BaseModelOutputWithPast = self.model(
            input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids, cache=cache,
            inputs_embeds=inputs_embeds, use_cache=use_cache, ddl_readout_weights=ddl_readout_weights, **kwargs)
        logits = self.lm_head(slice_logits_to_keep(outputs.last_hidden_state, logits_to_keep))
        loss = None
        if labels is not None:
            loss = self.loss_function(logits=logits, labels=labels, vocab_size=self.config.vocab_size, **kwargs)
        return CausalLMOutputWithPast(loss=loss, logits=logits, cache=outputs.cache,
                                      hidden_states=outputs.hidden_states, attentions=outputs.attentions)

    @property
    def init_continuous_batching(self):
        """GenerationMixin's, for variants without token convolutions: continuous batching's paged cache keeps only
        attention keys and values, not EC's and TC's inputs (`transformers serve` asks hasattr, then uses generate)."""
        if conv_state_slots(self.config):  # (EC or TC)
            raise AttributeError("init_continuous_batching")
        return super().init_continuous_batching

    def generate(self, *args, **kwargs):
        """GenerationMixin's, its steps sharing the readout weights. transformers' static cache layer for token windows
        (EC, TC) rolls back the windows but not the keys, so drafting decoding over one is refused before it starts."""
        config = kwargs.get("generation_config") or self.generation_config
        static = kwargs.get("cache_implementation", config.cache_implementation) == "static" or isinstance(
            kwargs.get("past_key_values", kwargs.get("cache")), StaticCache)
        drafts = kwargs.get("assistant_model") is not None or kwargs.get(
            "prompt_lookup_num_tokens", config.prompt_lookup_num_tokens)
        if static and drafts and conv_state_slots(self.config):
            raise ValueError("Assisted or prompt-lookup decoding cannot roll back a static cache that also holds "
                             "token windows (DDL's EC, TC): use the default dynamic cache (drop "
                             "cache_implementation='static').")
        if kwargs.get("assistant_model") is None:  # (an assistant is given generate's kwargs: a Llama would refuse it)
            kwargs = {"ddl_readout_weights": {}, **kwargs}  # (dropped with the call)
        return super().generate(*args, **kwargs)

    def generate_batch(self, *args, **kwargs):
        if conv_state_slots(self.config):  # (EC or TC)
            raise ValueError("DDL: continuous batching keeps only attention keys and values per request, not the "
                             "inputs EC/TC read: use generate(), or d_v=1, or CC with ddl_embed_conv=False.")
        return super().generate_batch(*args, **kwargs)


MODEL_FOR_CAUSAL_LM_MAPPING_NAMES.setdefault("ddl", "DDLForCausalLM")  # a causal LM to Trainer, lm-eval and serve


# ---------------------------------------------------------------------------------------------------------------
# Task heads: transformers' own generic heads (as Llama has them) on DDLModel's last_hidden_state (B, T, d), the
# normalised readout of the state whatever d_v is.


class _BaseModelFromConfig:
    """Lets the generic heads' `AutoModel.from_config(config)` find DDLModel for this very config class: as remote code
    it is its own copy, which nothing registered (transformers would ask on stdin whether to run the code again)."""

    def __init__(self, config):
        AutoModel.register(type(config), DDLModel, exist_ok=True)
        super().__init__(config)


class DDLForSequenceClassification(_BaseModelFromConfig, GenericForSequenceClassification, DDLPreTrainedModel):
    """DDLModel with a linear `score` head read at each row's last non-pad token (batches need `config.pad_token_id`;
    either padding side); the loss follows `config.problem_type` (regression, single- or multi-label classification)."""


class DDLForTokenClassification(_BaseModelFromConfig, GenericForTokenClassification, DDLPreTrainedModel):
    """DDLModel with dropout and a linear `score` head on every token (cross-entropy; label -100 is ignored)."""


class DDLForQuestionAnswering(_BaseModelFromConfig, GenericForQuestionAnswering, DDLPreTrainedModel):
    """DDLModel with a linear `qa_outputs` head: span start and end logits per token (extractive QA)."""


__all__ = ["DDLForCausalLM", "DDLForQuestionAnswering", "DDLForSequenceClassification", "DDLForTokenClassification",
           "DDLModel", "DDLPreTrainedModel"]

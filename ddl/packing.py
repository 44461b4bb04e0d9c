r"""Packed and padded batches: where DDL's token convolutions (EC, TC) restart (documents) and what they skip (padding).

**Packed batches** (`Documents`: position ids restarting per document, as `DataCollatorWithFlattening` and TRL's
`packing=True` make, or `cu_seq_lens_q/k`): each document is spread out after K-1 zeros, convolved, and gathered back
(the row's first keeps the row's history); `Documents.attention_mask_function` keeps attention apart where needed.

**Padded batches** (`Padding`): left padding (`generate`'s) is zeroed, the zeros a sequence starts from; padding
elsewhere is compacted (real tokens moved together after the history, convolved, read back; the cache keeps the
row's last real inputs, so decoding continues them)."""

import torch
import torch.nn.functional as F
from transformers.masking_utils import find_packed_sequence_indices, packed_sequence_mask_function
from transformers.utils.import_utils import is_tracing


class Documents:
    """A packed batch's documents (`find_documents`): `index` `(B, T)` numbers each token's in its row (0: first)."""

    def __init__(self, index):
        self.index, self._positions = index, {}

    def _wide_positions(self, gap):
        """Each token's place in the wide layout, flattened over rows, and the wide row's length."""
        if gap not in self._positions:
            batch, seq_len = self.index.shape
            width = seq_len + gap * int(self.index[:, -1].max())  # (documents in the fullest row, less one: a sync)
            place = torch.arange(seq_len, device=self.index.device) + gap * self.index
            place = place + width * torch.arange(batch, device=self.index.device).unsqueeze(1)
            self._positions[gap] = (place.flatten(), width)
        return self._positions[gap]

    def spread(self, x, kernel):
        """x `(B, T, ...)` laid out with `kernel - 1` zeros before each document but the first of its row."""
        (place, width), rest = self._wide_positions(kernel - 1), x.shape[2:]
        wide = x.new_zeros(x.shape[0] * width, *rest).index_copy(0, place, x.reshape(-1, *rest))
        return wide.view(x.shape[0], width, *rest)

    def gather(self, y, kernel):
        """The tokens' outputs `(B, T, ...)` from the wide layout's `y` `(B, W, ...)`."""
        place, _ = self._wide_positions(kernel - 1)
        return y.reshape(-1, *y.shape[2:]).index_select(0, place).view(*self.index.shape, *y.shape[2:])

    def convolve(self, op, x, weight, history, implementation):
        """`op(x, weight, history, implementation)`, a causal convolution over x's tokens restarted at every document
        (the row's first continues `history`): the documents spread apart by K-1 zeros, convolved and gathered back;
        while tracing (no shape may follow the data), one tap at a time, its inputs masked to its token's document."""
        kernel, length = weight.shape[0], x.shape[1]
        if kernel == 1:
            return op(x, weight, history, implementation)
        if not is_tracing(x):
            return self.gather(op(self.spread(x, kernel), weight, history, implementation), kernel)
        past = history if history is not None else x.new_zeros(x.shape[0], kernel - 1, *x.shape[2:])
        full, index, out = torch.cat([past, x], dim=1), F.pad(self.index, (kernel - 1, 0)), 0
        for s in range(kernel):
            same = (index[:, s : s + length] == self.index).view(*self.index.shape, *[1] * (x.dim() - 2))
            tap = op(full[:, s : s + length] * same.to(x.dtype), weight[s : s + 1], None, implementation)
            out = out + tap.to(torch.promote_types(tap.dtype, torch.float32))  # (summed in at least fp32, as eager)
        return out.to(tap.dtype)

    def last_document(self, window):
        """A window `(B, C, W)` ending with this batch's tokens (time last, as the cache keeps conv inputs; before them
        the inputs the row's first document continues) with every input before its row's last document zeroed."""
        index = F.pad(self.index, (window.shape[-1] - self.index.shape[1], 0))
        return window * (index == self.index[:, -1:]).unsqueeze(1).to(window.dtype)

    def attention_mask_function(self, past_length=0):
        """transformers' mask function that keeps the documents apart in attention (a cache's `past_length` earlier
        tokens belong to each row's first document, which continues them)."""
        index = self.index
        if past_length:
            index = torch.cat([index.new_zeros(index.shape[0], past_length), index], dim=1)
        return packed_sequence_mask_function(index)


def find_documents(batch, seq_len, position_ids=None, cu_seq_lens_q=None):
    """The documents of a packed batch (no padding), or None when every row holds one (traced: never None), from
    `cu_seq_lens_q` (flash attention's), else position ids restarting in a row (`find_packed_sequence_indices`)."""
    if seq_len < 2:
        return None
    if cu_seq_lens_q is not None:
        starts = torch.zeros(batch * seq_len, dtype=torch.long, device=cu_seq_lens_q.device)
        bounds = cu_seq_lens_q[:-1].long()
        starts[bounds[bounds < batch * seq_len]] = 1
        starts = starts.view(batch, seq_len)
        starts[:, 0] = 0  # each row's first token continues the row's own history
        index = starts.cumsum(-1)
    elif position_ids is not None:
        index = find_packed_sequence_indices(position_ids.expand(batch, -1))
    else:
        return None
    if index is None or not is_tracing(index) and not bool(index[:, -1].any()):  # (traced: no branch on the data)
        return None
    return Documents(index)


def check_documents_start(position_ids):
    """Raises when a document begins at a position > 0 (position ids restart at each): it continues unseen tokens."""
    first = F.pad(position_ids[..., 1:] != position_ids[..., :-1] + 1, (1, 0), value=True)
    if not is_tracing(position_ids) and bool((first & (position_ids > 0)).any()):
        raise ValueError("DDL: position ids that do not start at 0 continue a sequence whose last inputs this "
                         "variant's token convolutions (EC/TC) read from the cache: pass the cache that saw them (as "
                         "generate() does), or feed each sequence from its first token.")


class Padding:
    """The padding of a batch over this forward's tokens, for the token convolutions (`Padding.of`, once a forward):
    `mask` `(B, T)` (1 = a real token) in the model dtype, and whether the rows must be compacted (`compacts`)."""

    def __init__(self, mask, compacts):
        self.mask, self.compacts, self._orders = mask, compacts, {}

    @classmethod
    def of(cls, pad_mask, dtype, cache=None):
        """The padding of `pad_mask` `(B, T)` (None: none) in a forward with `cache` (or None). Its rows are compacted
        unless every row's padding lies before its tokens (the zeros a convolution reads anyway), or, without a cache,
        also after them (no later token reads them); a row that continues its cache's tokens must have none. (One
        synchronisation with the device; while tracing, always compacted: the data cannot be looked at.)"""
        if pad_mask is None:
            return None
        real = pad_mask.bool()
        if is_tracing(real):
            return cls(pad_mask.to(dtype), True)
        runs = (real & ~F.pad(real, (1, 0))[:, :-1]).sum(-1)  # runs of real tokens in each row
        if cache is None:
            fine = runs <= 1
        elif cache.get_seq_length() == 0:
            fine = (runs == 0) | ((runs == 1) & real[:, -1])
        else:
            fine = real.all(-1)
        return cls(pad_mask.to(dtype), not bool(fine.all()))

    def masked(self, x):
        """x `(B, T, ...)` with its padded positions zeroed."""
        return x * self.mask.view(*self.mask.shape, *([1] * (x.dim() - 2)))

    def _order(self, kernel):
        """For a window of K-1 history inputs then the T tokens: the compacted order (the padding, then the history
        and the real tokens, each in order) as indices into the window `(B, K-1+T)`, and where each token landed
        among the last T places `(B, T)` (clamped to 0 for padding, whose output is zeroed)."""
        if kernel not in self._orders:
            real = self.mask > 0
            batch, seq_len = real.shape
            window = torch.cat([real.new_ones(batch, kernel - 1), real], 1)  # the history counts as real
            order = torch.sort(window.to(torch.int8), dim=1, stable=True).indices  # (B, K-1+T)
            place = torch.empty_like(order).scatter_(1, order, torch.arange(order.shape[1], device=order.device)
                                                     .expand_as(order))
            self._orders[kernel] = order, (place[:, kernel - 1 :] - (kernel - 1)).clamp(min=0)
        return self._orders[kernel]

    def compact(self, x, kernel, cache=None, layer_idx=0, slot=0):
        """x `(B, T, ...)` (padding zeroed) with each row compacted, and its causal window `(B, C, K-1+T)` (None at
        the start of a sequence); with a cache, the history comes from its conv-state `slot` of layer `layer_idx`,
        and the cache keeps the compacted row's last K-1 inputs."""
        batch, seq_len = x.shape[:2]
        flat = x.reshape(batch, seq_len, -1).transpose(1, 2)  # (B, C, T)
        had_past = cache is not None and cache.has_previous_state(layer_idx, slot)
        window = F.pad(flat, (kernel - 1, 0)) if not had_past else torch.cat(
            [cache.layers[layer_idx].conv_states[slot][..., -(kernel - 1) :].to(flat.dtype), flat], dim=-1)
        order, _ = self._order(kernel)
        window = window.gather(-1, order.unsqueeze(1).expand_as(window))  # (B, C, K-1+T)
        if cache is not None:  # (at least K-1 inputs: what the cache keeps is the compacted window's last K-1)
            cache.update_conv_state(window[..., -max(seq_len, kernel - 1) :], layer_idx, state_idx=slot,
                                    conv_kernel_size=kernel - 1)
        compacted = window[..., kernel - 1 :].transpose(1, 2).reshape(x.shape)
        return compacted, window if had_past else None

    def restore(self, y, kernel):
        """The outputs `(B, T, ...)` of a compacted row (`compact`) read back into each token's place (0 at padding)."""
        _, place = self._order(kernel)
        index = place.view(*place.shape, *([1] * (y.dim() - 2))).expand_as(y)
        return self.masked(y.gather(1, index))


__all__ = ["Documents", "Padding", "check_documents_start", "find_documents"]

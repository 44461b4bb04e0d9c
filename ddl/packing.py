r"""Packed batches: several documents in one row, kept apart by DDL's token convolutions (EC, TC).

transformers trains "padding-free" by packing documents into a row with no attention mask: position ids that restart
at each document (`DataCollatorWithFlattening`, TRL's `packing=True`), or flash attention's `cu_seq_lens_q/k`.
Attention keeps the documents apart; a causal token convolution would run across the boundary, reading the end of one
document into the first K-1 tokens of the next. `Documents` makes every token convolution restart at each document:

    spread:  the row laid out wider, each document after K-1 zeros (`(B, T) -> (B, T + (K-1)(n-1))`, n documents)
    conv:    the convolution runs there as on any row, by whichever implementation `ddl.kernels` chooses
    gather:  each token's output read back from its place

so each document sees zeros before its first token, exactly as when it runs alone; the first document of a row keeps
the row's own history (zeros, or the cache's). One index operation each way, differentiable, and no change to any
kernel. Unpacked batches never get here (`find_documents` returns None) and run as before. Where transformers' causal
mask would not keep the documents apart (it looks for packing only without a cache and without a mask), the model
adds `Documents.attention_mask_function` to it.
"""

import torch
from transformers.masking_utils import find_packed_sequence_indices, packed_sequence_mask_function
from transformers.utils.import_utils import is_tracing

from .rebuild import derived


class Documents:
    """Where the documents of a packed batch lie: `index` `(B, T)` numbers each token's document within its row,
    0 for the row's first one. Built by `find_documents`."""

    def __init__(self, index):
        self.index = index
        self.count = int(index[:, -1].max()) + 1  # documents in the fullest row (one sync, packed batches only)
        self._positions = {}

    def _wide_positions(self, gap):
        """Each token's place in the wide layout, flattened over rows, and the wide row's length."""
        if gap not in self._positions:
            batch, seq_len = self.index.shape
            width = seq_len + gap * (self.count - 1)
            place = torch.arange(seq_len, device=self.index.device) + gap * self.index
            place = place + width * torch.arange(batch, device=self.index.device).unsqueeze(1)
            self._positions[gap] = (place.flatten(), width)
        return self._positions[gap]

    def spread(self, x, kernel):
        """x `(B, T, ...)` laid out with `kernel - 1` zeros before each document but the first of its row."""
        place, width = self._wide_positions(kernel - 1)
        rest = x.shape[2:]
        wide = x.new_zeros(x.shape[0] * width, *rest).index_copy(0, place, x.reshape(-1, *rest))
        return wide.view(x.shape[0], width, *rest)

    def gather(self, y, kernel):
        """The tokens' outputs `(B, T, ...)` from the wide layout's `y` `(B, W, ...)`."""
        place, _ = self._wide_positions(kernel - 1)
        return y.reshape(-1, *y.shape[2:]).index_select(0, place).view(*self.index.shape, *y.shape[2:])

    def convolve(self, conv, x, kernel):
        """`conv(x)` for a causal convolution of `kernel` taps over x's token axis, restarted at every document."""
        if kernel == 1:
            return conv(x)
        # (with the states rebuilt in backward, so is the spread copy of one: `rebuild.derived`)
        return self.gather(conv(derived(lambda state: self.spread(state, kernel), x)), kernel)

    def last_document(self, x):
        """x `(B, C, T)` (time last, as the cache keeps conv inputs) with every token before its row's last
        document zeroed: what a cache may keep, so that decoding continues the last document alone."""
        return x * (self.index == self.index[:, -1:]).unsqueeze(1).to(x.dtype)

    def attention_mask_function(self, past_length=0):
        """transformers' mask function that keeps the documents apart in attention (a cache's `past_length` earlier
        tokens belong to each row's first document, which continues them)."""
        index = self.index
        if past_length:
            index = torch.cat([index.new_zeros(index.shape[0], past_length), index], dim=1)
        return packed_sequence_mask_function(index)


def find_documents(batch, seq_len, position_ids=None, cu_seq_lens_q=None, cache=None):
    """The documents of a packed batch of `batch` rows of `seq_len` tokens, or None when every row holds one.

    Call it only for inputs without padding (no attention mask, or an all-ones one). The documents come from
    `cu_seq_lens_q` (flash attention's cumulative lengths over the flattened rows) when given, else from position ids
    that restart inside a row (transformers' `find_packed_sequence_indices`: a new document wherever a position is
    not the previous one plus 1). While tracing (torch.compile, torch.export), position ids are read only without a
    cache, as transformers does for attention; whether they restart, and the packed layout's width, come from the
    data there: a graph break under torch.compile (the numbers stay right), an error under `fullgraph=True`.
    """
    if seq_len < 2:
        return None
    if cu_seq_lens_q is not None:
        starts = torch.zeros(batch * seq_len, dtype=torch.long, device=cu_seq_lens_q.device)
        bounds = cu_seq_lens_q[:-1].long()
        starts[bounds[bounds < batch * seq_len]] = 1
        starts = starts.view(batch, seq_len)
        starts[:, 0] = 0  # each row's first token continues the row's own history
        index = starts.cumsum(-1)
    elif position_ids is not None and (cache is None or not is_tracing(position_ids)):
        index = find_packed_sequence_indices(position_ids.expand(batch, -1))
    else:
        return None
    if index is None or not bool(index[:, -1].any()):  # every row one document (cu_seq_lens, or while tracing)
        return None
    return Documents(index)


__all__ = ["Documents", "find_documents"]

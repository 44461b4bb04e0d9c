r"""Rebuilding the expanded states in backward instead of keeping them (`ddl_rebuild_states`).

Each sublayer's update reads its input state X_l `(B, T, d_v, d)` in backward (the delta update's gradients, the
compressor's weight gradients), so autograd keeps every X_l: d_v times the residual per sublayer, most of what an
expanded state costs in training. The update is undone by what it wrote,

    X_{l+1} = X_l + a_l c_l^T   =>   X_l = X_{l+1} - a_l c_l^T        (`fused.rebuild_state`)

(a_l is the sublayer output h, which backward keeps anyway, c_l d_v numbers per token), so backward can rebuild
each state from the next one, as reversible networks do, keeping only the last state.

`StateTape` does it with autograd's saved-tensor hooks, for every operation that saves a state, whatever its
implementation: while the tape is active (one forward, `DDLModel.forward`), inside the modules that read the state
(`saving_states`: the delta residual and the compressors), a tensor saved for backward that *is* the current state
(or a view of it) is saved as its index on the tape instead, and unpacked in backward by rebuilding it from the
state after it (the hooks are on there only, so that what attention and the MLP save does not go through Python).
The updates put their output and their write on the tape (`kernels.delta_residual(tape=...)`); when the next state
comes, the tape lets go of the previous one, whose memory a later state then takes (`buffer_like`). Backward runs
the sublayers in reverse, and the gradient of X_{l+1} is complete (every reader of X_{l+1} has run its backward)
before any reader of X_l runs its own, so each state is rebuilt once, from the one above it and written over it
(nothing else holds it by then; `_sole_owner` checks). After forward one state is alive instead of 2L + 1 (tested);
at bench size CC+EC's peak training memory goes from 1.29x Llama's to 1.07x (docs/performance.md). A copy made
from a state is saved as usual (correct, just not rebuilt: e.g. the stride-0 X_0 of a model without EC, which the
C++ kernel copies), unless it was made through `derived` (the TC input masked at padding, a packed batch's spread
layout): then backward makes it again from the rebuilt state.

Rounding: the rebuilt X_l differs from the stored one by the rounding of X_{l+1} in the model dtype, one rounding
per update, adding up over the depth (not amplified: the writes are the stored ones); relative to X_l that is the
dtype's resolution times |X_{l+1}| / |X_l|, large for the first states, which are much smaller than the later ones.
In fp32/fp64 it stays at the level of the model's own rounding; in bf16 it is not, hence the per-dtype default of
"auto" (`rebuild_applies`; docs/performance.md).
"""

import contextlib
import threading
import weakref

import torch

from .configuration_ddl import REBUILD_CHOICES
from .fused import rebuild_state


class StateTape:
    """The states of one forward: the current one held, the earlier ones dropped and rebuilt on demand in backward.

    `start(x0)` with the first state, then `push(x_next, write)` after each update (`fused.rank1_write` factors,
    X_next = X + a (x) c, or a function that makes them); use it as a context manager around the forward, reach it
    from the updates with `active_tape()`, and run what saves a state under `saving_states()`.
    """

    def __init__(self):
        # the pack hook reaches the tape through a weak reference: a bound method would make a reference cycle
        # (tape -> hooks -> tape), and the tape, with the last state and every write, would then outlive its
        # graph until the cyclic garbage collector ran (on CPU: a few hundred MB more resident memory per step)
        tape = weakref.ref(self)
        self.hooks = torch.autograd.graph.saved_tensors_hooks(lambda tensor: tape()._pack(tensor), self._unpack)
        self.states = []  # X_l: the current one (and, in backward, the last one rebuilt); None where let go
        self.writes = []  # the write of update l: X_{l+1} = X_l + a c^T
        self._derived = []  # (weak ref, fn): tensors made from the current state by fn (`derived`)
        self._spares = []  # states let go in forward, whose memory the next states can take (`buffer_like`)
        self._previous = None

    def __enter__(self):
        self._previous, _active.tape = active_tape(), self
        return self

    def __exit__(self, *exc):
        _active.tape = self._previous
        self._spares = []
        return False

    def start(self, x0):
        self.states = [x0]
        self.writes = []
        return x0

    def push(self, x_next, write):
        """X_{l+1} after the update whose write is `write`; the tape lets go of X_l (backward rebuilds it)."""
        self._spares = [self.states[-1], *self._spares][:SPARES]
        self.states[-1] = None
        self.states.append(x_next)
        self.writes.append(write)
        self._derived = []
        return x_next

    def buffer_like(self, x):
        """Memory for the next state, X's shape and layout: a state let go earlier in this forward that nothing
        holds any more (the caller's loop still holds a layer's input while its second sublayer runs, hence
        `SPARES`), or None. Forward then writes the states into a few buffers in turn instead of allocating each
        one and leaving holes that other tensors fragment (bench size, CPU, glibc: 65k instead of 108k page faults
        per training step, 1.02x [0.94-1.12] steps/s over 8 alternated pairs; docs/performance.md)."""
        for i, spare in enumerate(self._spares):
            if (spare.shape == x.shape and spare.stride() == x.stride() and spare.dtype == x.dtype
                    and spare.device == x.device and spare.data_ptr() != x.data_ptr() and _sole_owner(spare)):
                del self._spares[i]
                # a fresh tensor over its memory: no autograd history, and not a view (the update's output is not)
                return spare.new_empty(0).set_(spare.untyped_storage(), spare.storage_offset(), spare.shape,
                                               spare.stride())
        return None

    def derive(self, y, x, fn):
        """Records y = fn(x) for a copy of the current state (x the state or a tensor derived from it), so that
        a save of y is rebuilt too, as fn of the rebuilt state. fn must be exact and cheap to run again."""
        made = self._recipe(x)
        if made is not None:  # held weakly: the tape lives as long as the graph
            self._derived.append((weakref.ref(y), fn if made is _same else lambda state: fn(made(state))))

    def _recipe(self, tensor):
        """How `tensor` is made from the current state (a function of the state), or None if it is not: the state
        itself, a tensor recorded by `derive`, or a view of one of them (e.g. a reshape that an operation saves)."""
        if not self.states or self.states[-1] is None:
            return None
        if tensor is self.states[-1]:
            return _same
        for ref, fn in self._derived:
            if tensor is ref():
                return fn
        base = tensor._base
        if base is None or not base.is_contiguous():  # (rebuilt tensors are contiguous)
            return None
        made = self._recipe(base)
        state = self.states[-1]
        if made is None and base is state._base and _same_layout(state, base):  # the state is a view of it too
            made = _same
        if made is None:
            return None
        size, stride, offset = tensor.size(), tensor.stride(), tensor.storage_offset()
        return lambda state: made(state).as_strided(size, stride, offset)

    # --- the hooks: a saved state becomes its index; backward gets it back, rebuilt
    def _pack(self, tensor):
        made = self._recipe(tensor)
        return tensor if made is None else _Saved(self, len(self.states) - 1, made)

    @staticmethod
    def _unpack(saved):
        if not isinstance(saved, _Saved):
            return saved
        state = saved.tape.state(saved.index)
        made = saved.fn(state)
        # the state itself goes out as an alias of its storage, so that `_sole_owner` sees it held while in use
        return made.detach() if made is state else made

    def state(self, index):
        """X_index: held, or rebuilt from the nearest held state above it (the last one is always held). After a
        rebuild the state above is let go: backward reads the states in reverse order."""
        if torch.is_grad_enabled():
            raise RuntimeError("DDL: a second derivative (create_graph=True) through a model whose states are rebuilt "
                               "in backward is not supported; set config.ddl_rebuild_states = 'off'.")
        above = index
        while self.states[above] is None:
            above += 1
        x = self.states[above]
        for layer in range(above - 1, index - 1, -1):
            # over the state above where nothing else holds it (not the last state, which the tape keeps): backward
            # then allocates no new state (and on CPU, with glibc's allocator, no freshly mapped pages for it)
            in_place = above < len(self.states) - 1 or layer < above - 1
            write = self.writes[layer]
            write = write() if callable(write) else write  # (the C++ update's: made from its saved numbers)
            x = rebuild_state(x, write, in_place=in_place and _sole_owner(x))
        if above > index:
            self.states[index] = x
            if above < len(self.states) - 1:
                self.states[above] = None
        return x


def _sole_owner(x):
    """Whether nothing but `x` (no view, alias or saved copy handed out by `_unpack`) holds x's storage. (A private
    torch function; without it, never: the states are then rebuilt into new tensors, as correct, with more
    allocation.)"""
    use_count = getattr(torch._C, "_storage_Use_Count", None)
    return use_count is not None and use_count(x.untyped_storage()._cdata) <= 2  # x's own reference + this call's


def _same(state):
    return state


def _same_layout(state, base):
    """Whether a contiguous `base` holds the same elements in the same places as the state (a reshape of it)."""
    return (state.is_contiguous() and state.numel() == base.numel()
            and state.storage_offset() == base.storage_offset())


SPARES = 2  # dead states kept for `buffer_like`: each block's input stays alive until the block returns


class _Saved:
    """A state (or fn of it) saved for backward as its place on the tape."""

    __slots__ = ("fn", "index", "tape")

    def __init__(self, tape, index, fn):
        self.tape, self.index, self.fn = tape, index, fn


_active = threading.local()  # the tape of the forward that this thread runs (saved-tensor hooks are per thread too)


def active_tape():
    """The `StateTape` of the forward that runs now in this thread, or None."""
    return getattr(_active, "tape", None)


def saving_states():
    """Context for the operations that read the state (and save it for backward): under an active tape, what they
    save that is the state goes on the tape (`StateTape`); otherwise nothing."""
    tape = active_tape()
    return _NOTHING if tape is None else tape.hooks


_NOTHING = contextlib.nullcontext()  # (reentrant; one for every call: decoding enters it 2L + 1 times per token)


def derived(fn, x):
    """fn(x); under an active tape, a copy of the state x made by fn (masked, spread) is rebuilt in backward like
    the state itself instead of being kept (`StateTape.derive`)."""
    y = fn(x)
    tape = active_tape()
    if tape is not None:
        tape.derive(y, x, fn)
    return y


def rebuild_applies(config, dtype, training_with_checkpointing=False):
    """Whether a forward of states in `dtype` rebuilds them in backward: `config.ddl_rebuild_states` ("on"; "auto":
    fp32/fp64 states, see docs/performance.md) and this forward one where it is exact and pays off:

    - autograd records (grad enabled), an expanded state (d_v > 1), a delta or write-only update;
    - `ddl_implementation` "auto" or "torch" ("reference" is the specification, which keeps its states; "triton"'s
      update has no write to give the tape yet);
    - not torch.compile / tracing: the compiled graph decides itself what it keeps, and Python hooks would not run
      in it the same way;
    - not gradient checkpointing: it keeps each block's input state for the recomputation anyway, and recomputes
      the block's forward in backward (the tape would see the updates twice).
    """
    choice = config.ddl_rebuild_states
    if choice == "off" or (choice == "auto" and dtype not in (torch.float32, torch.float64)):
        return False
    return (
        torch.is_grad_enabled()
        and config.ddl_value_channels > 1
        and config.ddl_residual in ("delta", "write_only")
        and config.ddl_implementation in ("auto", "torch")
        and not training_with_checkpointing
        and not torch.compiler.is_compiling()
        and not torch.jit.is_tracing()
    )


__all__ = ["REBUILD_CHOICES", "StateTape", "active_tape", "derived", "rebuild_applies", "saving_states"]

"""The compressor interface: compress, decompress, and an error-feedback memory."""
from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass, field
from typing import Any, Callable, Sequence

import numpy as np
import torch

from convoy.compress.buffers import Spares

Payload = list[torch.Tensor]
# ``place(key, like)``: where an error-feedback memory's new tensor of ``key`` goes (:meth:`Memory.place_in`).
Place = Callable[[str, torch.Tensor], "torch.Tensor | None"]


def _no_peers(tensor: torch.Tensor) -> torch.Tensor:
    return tensor


@dataclass(frozen=True)
class LayerInfo:
    """What a compressor may know about a flat gradient besides its values.

    Args:
        shapes: the shapes of the parameters concatenated in the flat gradient,
            in order (block-sparse compressors cut blocks along them).
        agree: sums a small tensor over every rank of the exchange, in place,
            and returns it; lets a compressor choose the same selection on
            every rank (global block selection). The default is a world of one.
        step: the training step being exchanged, the same on every rank
            (seeds random selections so they agree across ranks and resumes).
        density: send at least this fraction of the layer this time (the
            warm-up's ramp); sparse compressors honour it, others ignore it.
        world_size: ranks whose payloads will be summed (fp16 keeps each
            rank's share of the sum within its range).
        remote: the final payload is decoded by a receiver that knows only
            the shapes, step and density (a parameter server), with the
            context of compressing zeros: the payload must then carry
            whatever else decoding needs (PowerSGD's agreed basis).

    Example::

        >>> info = LayerInfo(shapes=(torch.Size([6, 1, 5, 5]), torch.Size([6])))
    """

    shapes: tuple[torch.Size, ...] = ()
    agree: Callable[[torch.Tensor], torch.Tensor] = field(default=_no_peers, compare=False)
    step: int | None = None
    density: float | None = None
    world_size: int = 1
    remote: bool = False


class Support(ABC):
    """Where a decoded flat gradient may hold non-zero values: every element outside
    :meth:`ranges` is exactly ``+0.0``, so a consumer (a differential checkpoint's record)
    can read those ranges instead of scanning the whole gradient. Computed only when asked:
    the exchange that makes one pays nothing for it.
    """

    @abstractmethod
    def ranges(self) -> tuple[np.ndarray, np.ndarray]:
        """``(starts, lengths)``: int64 element ranges ``[start, start + length)``, each length
        >= 1, possibly overlapping, in no particular order."""


class Compressor(ABC):
    """Turns a layer's flat gradient into the tensors that cross the network.

    ``summable`` says whether payloads from different ranks can be added
    element-wise, which lets a sync strategy all-reduce them; otherwise it must
    gather every rank's payload and decompress each.
    """

    summable: bool = True
    # Whether decompressing the final payload summed over the ranks feeds the
    # next compress (PowerSGD's warm start): an exchange that never sums it
    # (a parameter-server push) must sum its first tensor (a remote payload's
    # others carry the agreed context) over the ranks and hand it to keep_sum.
    keeps_sum: bool = False
    # The share of a layer a sparse compressor sends (None: dense, or a fixed count);
    # a warm-up ramps the density down to it.
    density: float | None = None
    # Whether compress reads nothing of the other ranks (no ``info.agree``, no rounds, no warm
    # start from a summed payload): the error-feedback memory's update then depends on this
    # rank's gradient alone, so a resume can rebuild it by replaying the steps locally.
    local: bool = False
    # Whether :meth:`unsent` may write the residual over ``compensated`` itself (``out`` is
    # ``compensated``): the payload is a copy, and nothing after the residual (the exchange, the
    # decompression of the sum) reads ``compensated``'s values. The memory then keeps the
    # compensated buffer as the residual instead of writing a second gradient-sized tensor.
    residual_in_place: bool = False

    @abstractmethod
    def compress(self, tensor: torch.Tensor, name: str,
                 info: LayerInfo | None = None) -> tuple[Payload, Any]:
        """Return the payload for ``tensor`` and the context decompress needs.

        ``info`` carries what the sync strategy knows of the layer (parameter
        shapes, a way to agree with the peers, the step); compressors that do
        not need it ignore it.
        """

    @abstractmethod
    def decompress(self, payload: Payload, ctx: Any) -> torch.Tensor:
        """Rebuild a dense tensor from ``payload``."""

    def decompress_add(self, payload: Payload, ctx: Any, out: torch.Tensor) -> torch.Tensor:
        """Add the dense tensor of ``payload`` to ``out`` in place and return ``out``.

        Summing every rank's gathered payload this way spares a dense tensor per
        rank; sparse compressors override it to touch only what they carry.
        """
        return out.add_(self.decompress(payload, ctx))

    def decompress_sum(self, payloads: list[Payload], ctx: Any) -> tuple[torch.Tensor, Support | None]:
        """The sum of the dense tensors of ``payloads``, added in the order given (so every rank
        that adds the same payloads gets the identical sum), and where it may be non-zero
        (None: anywhere). Sparse compressors that know their blocks say where.
        """
        total = self.decompress(payloads[0], ctx)
        for payload in payloads[1:]:
            self.decompress_add(payload, ctx, total)
        return total, None

    def decompress_mean_into(self, payloads: list[Payload], ctx: Any, out: torch.Tensor,
                             count: int) -> tuple[torch.Tensor, Support | None]:
        """:meth:`decompress_sum` divided by ``count`` (the ranks summed), built in ``out`` where the
        compressor would otherwise make a new tensor. ``out`` has the sum's size and type and the
        caller no longer needs it (the exchanged gradient), so building the mean there spares an
        allocation and the caller's copy into its buffer, and a compressor may fold the division
        into a smaller tensor than the mean (PowerSGD divides its thin factor). The default
        ignores ``out`` and divides the sum in place; what is returned is the mean either way.

        Example::

            >>> mean, support = compressor.decompress_mean_into([summed], ctx, grad, world_size)
        """
        total, support = self.decompress_sum(payloads, ctx)
        return total.div_(count), support

    def certainly_finite(self, summed: Payload, ctx: Any) -> bool:
        """Whether decompressing ``summed`` (the final payload summed over the ranks) gives only
        finite values, as far as the payload alone tells: a bound on the few values sent stands in
        for a pass over the many decoded. False means not known (the default), and the caller
        checks the decoded gradient itself.

        Example::

            >>> if not compressor.certainly_finite(summed, ctx):
            ...     check_finite(mean, step, "layer 3")
        """
        return False

    def unsent(self, compensated: torch.Tensor, payload: Payload, ctx: Any,
               out: torch.Tensor | None = None) -> torch.Tensor:
        """``compensated`` minus what ``payload`` (this rank's final payload) sends of it: the
        error-feedback residual, written into ``out`` when given.

        The default decompresses the payload and subtracts; a compressor may compute the
        same difference without the decompressed tensor (PowerSGD).
        """
        # A host-coded payload (run lengths, rows) decodes on the CPU; the residual stays where the gradient is.
        sent = self.decompress(payload, ctx).to(compensated.device)
        return compensated - sent if out is None else torch.sub(compensated, sent, out=out)

    def more_rounds(self, ctx: Any) -> bool:
        """Whether the payload just made is an intermediate round (PowerSGD's P before its Q).

        An exchange then sums it over the ranks, blocking, and hands the sum
        to :meth:`next_round`; it repeats until this is False and exchanges
        the last payload as usual. Only summable compressors have rounds.
        """
        return False

    def next_round(self, summed: Payload, ctx: Any) -> tuple[Payload, Any]:
        """The next round's payload and context, given this round's payload summed over the ranks."""
        raise NotImplementedError(f"{type(self).__name__} has a single round")

    def keep_sum(self, summed: Payload, ctx: Any) -> None:
        """Keep what the next step needs of the final payload summed over the ranks (see ``keeps_sum``)."""

    def forget(self, name: str) -> None:
        """Drop what is kept for layer ``name`` (its layout changed, e.g. DDP rebuilt its buckets)."""

    def state_tensors(self) -> dict[str, torch.Tensor]:
        """State a bit-identical resume needs (a warm start), by stable ``kind.name`` keys."""
        return {}

    def load_state_tensors(self, tensors: dict[str, torch.Tensor]) -> None:
        """Take back this compressor's keys of what :meth:`state_tensors` returned; ignore the others."""

    def state_bytes_bound(self, params_bytes: int) -> int:
        """At most how many bytes :meth:`state_tensors` holds, for parameters of ``params_bytes``."""
        return 0

    def max_payload_bytes(self, ctx: Any) -> int | None:
        """An upper bound on the payload's bytes that every rank computes alike, or None.

        A non-summable compressor that knows one lets a sync strategy gather
        payloads padded to it in one collective, without first exchanging sizes.
        """
        return None


class Memory(ABC):
    """What a compressor could not send, kept for the next step (error feedback)."""

    # Whether compensate wants the layer's parameters (to add weight decay).
    needs_params: bool = False
    # The kinds of :meth:`kept` whose tensors are replaced by new ones every step, never
    # written into: a reference to one is a snapshot (a checkpoint need not copy it).
    replaced_each_step: tuple[str, ...] = ()
    # Where new tensors go (:meth:`place_in`); None: new tensors.
    _place: Place | None = None

    def __init__(self) -> None:
        # Buffers of replaced tensors, reused unless a snapshot was handed them (:meth:`state_tensors`).
        self._spares = Spares()

    def place_in(self, place: Place | None) -> None:
        """Build the new tensors of :meth:`state_tensors` where ``place`` says from now on.

        ``place(key, like)`` returns where the new tensor of ``key`` (a key of
        :meth:`state_tensors`) goes, a tensor shaped like ``like``, or None for a
        new tensor; the values are the same either way. A checkpoint that writes
        the residuals from memory of its own passes one; ``None`` goes back to new
        tensors.

        Example::

            >>> memory.place_in(lambda key, like: arena.place("sync." + key, like, step))
            >>> memory.place_in(None)
        """
        self._place = place

    @abstractmethod
    def compensate(self, tensor: torch.Tensor, name: str,
                   params: torch.Tensor | Sequence[torch.Tensor] | None = None) -> torch.Tensor:
        """Add what earlier steps left unsent to this step's gradient.

        ``params`` are the layer's parameters, given when ``needs_params``: flat,
        or each parameter tensor in the order the flat gradient concatenates them.
        """

    @abstractmethod
    def update(self, compensated: torch.Tensor, name: str, sent: torch.Tensor) -> None:
        """Remember ``compensated - sent`` as the new residual."""

    def keep_unsent(self, compensated: torch.Tensor, name: str, compressor: Compressor, payload: Payload,
                    ctx: Any) -> None:
        """:meth:`update` with what ``compressor`` sends of ``compensated`` in ``payload`` (its
        decompression). A memory whose update is the residual alone overrides it to have the
        compressor compute the residual directly (:meth:`Compressor.unsent`); a subclass of one
        of those that overrides :meth:`update` overrides this too."""
        self.update(compensated, name, compressor.decompress(payload, ctx))

    def unsent_residual(self, compensated: torch.Tensor, name: str, compressor: Compressor, payload: Payload,
                        ctx: Any) -> torch.Tensor:
        """The new residual ``compensated - sent`` of ``payload``, where :meth:`place_in`'s function puts
        it; else over ``compensated`` itself when the compressor allows it and ``compensated`` is one of
        this memory's buffers (:meth:`compensated_buffer`), else in a buffer of its own."""
        key = f"residual.{name}"
        out = self.placed(key, compensated)
        in_place = compressor.residual_in_place and self._spares.owns(compensated)
        if out is None:
            out = compensated if in_place else self._spares.take(key, compensated)
        compressor.unsent(compensated, payload, ctx, out)
        if out is not compensated:
            # Read by nothing after the residual (the compressor says so): reuse it; else let it go.
            (self._spares.release(key, compensated) if in_place else self._spares.drop(compensated))
        return out   # the buffer itself, not a view of it: replacing it later releases it

    def placed(self, key: str, like: torch.Tensor) -> torch.Tensor | None:
        """Where :meth:`place_in`'s function puts the new tensor of ``key``; None: a new tensor."""
        return None if self._place is None else self._place(key, like)

    def new_tensor(self, key: str, like: torch.Tensor) -> torch.Tensor:
        """Where the new tensor of ``key`` (``kind.name``, a kind of :meth:`kept`) goes: where
        :meth:`place_in`'s function puts it, else a buffer this memory made and no longer uses."""
        out = self.placed(key, like)
        return self._spares.take(key, like) if out is None else out

    def compensated_buffer(self, name: str, like: torch.Tensor) -> torch.Tensor:
        """A buffer for layer ``name``'s compensated gradient; it may become the residual
        (:meth:`unsent_residual`)."""
        return self._spares.take(f"residual.{name}", like)

    def replace(self, kind: str, name: str, new: torch.Tensor) -> None:
        """Keep ``new`` as ``name``'s tensor of ``kind``; the one it replaces is reused unless lent."""
        kept = self.kept()[kind]
        old = kept.get(name)
        kept[name] = new
        if old is not None and old is not new:
            self._spares.release(f"{kind}.{name}", old)

    def new_residual(self, compensated: torch.Tensor, name: str, sent: torch.Tensor) -> torch.Tensor:
        """``compensated - sent``, where :meth:`new_tensor` puts it."""
        residual = torch.sub(compensated, sent, out=self.new_tensor(f"residual.{name}", compensated))
        self._spares.drop(compensated)   # a sparse payload may still read it
        return residual

    def forget(self, name: str) -> None:
        """Drop what is kept for ``name`` (its layout changed, e.g. DDP rebuilt its buckets)."""

    def kept(self) -> dict[str, dict[str, torch.Tensor]]:
        """What is kept between steps, by kind (``residual``, ``velocity``) and layer name."""
        return {}

    def state_tensors(self) -> dict[str, torch.Tensor]:
        """:meth:`kept` as ``kind.name`` keys: what a bit-identical resume needs. A caller may keep
        references to them as a snapshot: they are never written into again."""
        state = {f"{kind}.{name}": t for kind, tensors in self.kept().items() for name, t in tensors.items()}
        self._spares.lend(state.values())
        return state

    def load_state_tensors(self, tensors: dict[str, torch.Tensor]) -> None:
        """Take back this memory's keys of what :meth:`state_tensors` returned; ignore the others."""
        kept = self.kept()
        self._spares.clear()
        for key, tensor in tensors.items():
            kind, name = key.split(".", 1)
            if kind in kept:
                kept[kind][name] = tensor.clone()


class NoMemory(Memory):
    """Drop whatever was not sent."""

    def compensate(self, tensor: torch.Tensor, name: str,
                   params: torch.Tensor | Sequence[torch.Tensor] | None = None) -> torch.Tensor:
        return tensor

    def update(self, compensated: torch.Tensor, name: str, sent: torch.Tensor) -> None:
        pass

    def keep_unsent(self, compensated: torch.Tensor, name: str, compressor: Compressor, payload: Payload,
                    ctx: Any) -> None:
        pass   # nothing kept: the payload need not be decompressed


class ResidualMemory(Memory):
    """Error feedback: the unsent part is added to the next step's gradient.

    Invariant: ``sent + new residual == gradient + old residual`` exactly,
    because the residual is computed as that difference.
    """

    replaced_each_step = ("residual",)

    def __init__(self) -> None:
        super().__init__()
        self.residuals: dict[str, torch.Tensor] = {}

    def compensate(self, tensor: torch.Tensor, name: str,
                   params: torch.Tensor | Sequence[torch.Tensor] | None = None) -> torch.Tensor:
        residual = self.residuals.get(name)
        return tensor if residual is None else torch.add(tensor, residual, out=self.compensated_buffer(name, tensor))

    def update(self, compensated: torch.Tensor, name: str, sent: torch.Tensor) -> None:
        self.replace("residual", name, self.new_residual(compensated, name, sent))

    def keep_unsent(self, compensated: torch.Tensor, name: str, compressor: Compressor, payload: Payload,
                    ctx: Any) -> None:
        self.replace("residual", name, self.unsent_residual(compensated, name, compressor, payload, ctx))

    def forget(self, name: str) -> None:
        self.residuals.pop(name, None)
        self._spares.forget(name)

    def kept(self) -> dict[str, dict[str, torch.Tensor]]:
        return {"residual": self.residuals}

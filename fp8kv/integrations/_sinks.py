"""The transformers cache's side of :mod:`fp8kv.transforms`: sink tokens and K centering per row.

The FP8 block pool (:mod:`._paging`) holds only each row's non-sink tokens; this module keeps,
per layer, the rows' sink keys/values (unquantized, ``[B, S, H, D]`` in the model's dtype) and
their K means (``[B, H, D]`` float32), and per step works out which columns are sink tokens,
which go to the FP8 cache, and where every query sits. No model library is imported here.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from ..errors import bad_argument
from ..transforms import KVTransform, center_keys, merge_sink_attention, row_key_means, sink_visibility


@dataclass
class SinkStep:
    """One forward step's transform bookkeeping, shared by every layer.

    Attributes:
        fp8_valid: ``[B, q_len]`` bool columns written to the FP8 cache (None: every column).
        query_index: ``[N]`` indices of the step's tokens (non-padding columns) in the flattened
            ``[B * q_len]`` input, or None when every column is a token.
        rows / positions: ``[N]`` int64: each token's row and absolute position in it.
        fp8_of_query: ``[N_fp8]`` indices into the N tokens of those in the FP8 cache (the FP8
            attention's queries, in order), or None when all N are.
        sink_cols / sink_rows / sink_pos: the sink tokens written this step (None: none): their
            column in ``[B * q_len]``, row and position (< S).
        mean_rows: rows whose K mean is fixed in this step (``"prefill"`` centering).
        all_rows: ``rows`` is ``arange(B)`` (decode without padding): no gather needed.
        sink_full: every row holds all S sink tokens (visibility then depends on windows only).
    """

    fp8_valid: torch.Tensor | None
    query_index: torch.Tensor | None
    rows: torch.Tensor
    positions: torch.Tensor
    fp8_of_query: torch.Tensor | None
    sink_cols: torch.Tensor | None
    sink_rows: torch.Tensor | None
    sink_pos: torch.Tensor | None
    mean_rows: list[int]
    all_rows: bool
    sink_full: bool
    min_position: int
    max_position: int
    _visible: dict = field(default_factory=dict)


@dataclass
class SinkLayer:
    """One layer's sink keys/values ``[B, S, H, D]`` and K means ``[B, H, D]`` (float32); ``centered``:
    the sink keys minus the means in float32 (kept between steps: both change only while rows fill)."""

    sink_k: torch.Tensor | None = None
    sink_v: torch.Tensor | None = None
    means: torch.Tensor | None = None
    centered: torch.Tensor | None = None


class SinkState:
    """Rows' sink tokens and K means over every layer (see the module docstring)."""

    def __init__(self, transform: KVTransform, num_layers: int):
        self.transform = transform
        self.num_layers = num_layers
        self.reset()

    def reset(self) -> None:
        self.sink_lens: list[int] = []
        self.mean_set: list[bool] = []
        self.layers = [SinkLayer() for _ in range(self.num_layers)]
        self.step: SinkStep | None = None

    # -- per step ---------------------------------------------------------------------
    def begin_step(self, valid: torch.Tensor | None, batch_size: int, q_len: int, fp8_lens: list[int],
                   device: torch.device) -> SinkStep:
        """Split the step's columns into sink and FP8 tokens (``fp8_lens``: the pool's per-row
        FP8 tokens before the step)."""
        S = self.transform.sink_tokens
        if not self.sink_lens:
            self.sink_lens = [0] * batch_size
            self.mean_set = [False] * batch_size
        fp8_lens = fp8_lens or [0] * batch_size  # the pool's first step sets its rows
        if len(fp8_lens) != batch_size:
            return self._batch_mismatch(batch_size, len(fp8_lens))
        totals = [f + s for f, s in zip(fp8_lens, self.sink_lens, strict=True)]
        counts = [q_len] * batch_size if valid is None else valid.sum(dim=1).tolist()
        sink_any = any(t < S and c for t, c in zip(totals, counts, strict=True))
        if valid is None:
            rank = torch.arange(q_len, device=device).expand(batch_size, q_len)
            query_index = None
        else:
            valid = valid.to(device=device, dtype=torch.bool)
            rank = valid.to(torch.int64).cumsum(dim=1) - 1
            query_index = None if sum(counts) == batch_size * q_len else valid.reshape(-1).nonzero().reshape(-1)
        pos = torch.tensor(totals, dtype=torch.int64, device=device)[:, None] + rank  # [B, q]
        rows = torch.arange(batch_size, device=device)[:, None].expand(batch_size, q_len).reshape(-1)
        flat_pos = pos.reshape(-1)
        if query_index is not None:
            rows, flat_pos = rows[query_index], flat_pos[query_index]
        fp8_valid, fp8_of_query, sink_cols = valid, None, None
        sink_rows = sink_pos = None
        if sink_any:
            is_sink = pos < S if valid is None else valid & (pos < S)
            fp8_valid = ~is_sink if valid is None else valid & ~is_sink
            sink_cols = is_sink.reshape(-1).nonzero().reshape(-1)
            sink_rows = sink_cols // q_len
            sink_pos = pos.reshape(-1)[sink_cols]
            fp8_of_query = (flat_pos >= S).nonzero().reshape(-1)
        new_fp8 = [max(0, t + c - max(t, S)) if c else 0 for t, c in zip(totals, counts, strict=True)]
        mean_rows = []
        if self.transform.k_centering == "prefill":
            mean_rows = [b for b in range(batch_size) if not self.mean_set[b] and new_fp8[b] > 0]
            for b in mean_rows:
                self.mean_set[b] = True
        self.sink_lens = [min(S, t + c) for t, c in zip(totals, counts, strict=True)]
        firsts = [t for t, c in zip(totals, counts, strict=True) if c]
        lasts = [t + c - 1 for t, c in zip(totals, counts, strict=True) if c]
        self.step = SinkStep(
            fp8_valid=fp8_valid, query_index=query_index, rows=rows, positions=flat_pos, fp8_of_query=fp8_of_query,
            sink_cols=sink_cols, sink_rows=sink_rows, sink_pos=sink_pos, mean_rows=mean_rows,
            all_rows=query_index is None and q_len == 1, sink_full=all(n == S for n in self.sink_lens),
            min_position=min(firsts, default=0), max_position=max(lasts, default=0))
        return self.step

    def static_step(self, batch_size: int, device: torch.device) -> SinkStep:
        """The step of a static decode step: one FP8 token per row, every row's sinks full and
        visible, means set (the caller checked it; nothing here reads the device)."""
        rows = torch.arange(batch_size, device=device)
        S = self.transform.sink_tokens
        return SinkStep(fp8_valid=None, query_index=None, rows=rows, positions=rows, fp8_of_query=None,
                        sink_cols=None, sink_rows=None, sink_pos=None, mean_rows=[], all_rows=True, sink_full=True,
                        min_position=S, max_position=S)

    def _batch_mismatch(self, got: int, have: int):
        raise bad_argument("input", f"batch size {got}", f"the cache's batch size {have} (call cache.reset() "
                           "for a new batch)")

    def _visible(self, step: SinkStep, sliding_window: int | None) -> torch.Tensor | None:
        """``[N, S]`` sink visibility for a window (None: every sink token is visible)."""
        S = self.transform.sink_tokens
        if step.sink_full and step.min_position >= S - 1 and (
                sliding_window is None or step.max_position < sliding_window):
            return None
        if sliding_window not in step._visible:
            lens = torch.tensor(self.sink_lens, device=step.rows.device)[step.rows]
            step._visible[sliding_window] = sink_visibility(lens, step.positions, S, sliding_window)
        return step._visible[sliding_window]

    # -- per layer --------------------------------------------------------------------
    def store(self, layer_idx: int, key: torch.Tensor, value: torch.Tensor, step: SinkStep) -> torch.Tensor:
        """Keep the step's sink tokens of ``key``/``value`` ``[B, q_len, H, D]``, fix the K means
        of new rows and return the keys to write to the FP8 cache (centered if configured)."""
        B, q_len, H, D = key.shape
        S = self.transform.sink_tokens
        lay = self.layers[layer_idx]
        if S and (lay.sink_k is None or lay.sink_k.shape[0] != B):
            lay.sink_k = key.new_zeros((B, S, H, D))
            lay.sink_v = value.new_zeros((B, S, H, D))
        if step.sink_cols is not None or step.mean_rows:
            lay.centered = None
        if step.sink_cols is not None:
            lay.sink_k[step.sink_rows, step.sink_pos] = key.reshape(B * q_len, H, D)[step.sink_cols]
            lay.sink_v[step.sink_rows, step.sink_pos] = value.reshape(B * q_len, H, D)[step.sink_cols]
        mode = self.transform.k_centering
        if mode is None:
            return key
        if lay.means is None or lay.means.shape[0] != B:
            if mode == "calibrated":
                lay.means = self.transform.k_means[layer_idx].to(key.device).expand(B, H, D).contiguous()
            else:
                lay.means = torch.zeros((B, H, D), dtype=torch.float32, device=key.device)
            lay.centered = None
        if step.mean_rows:
            rows = torch.tensor(step.mean_rows, device=key.device)
            lay.means[rows] = row_key_means(key, step.fp8_valid)[rows]
        return center_keys(key, lay.means)

    def attend(self, layer_idx: int, query: torch.Tensor, out_fp8: torch.Tensor | None, lse_fp8: torch.Tensor | None,
               step: SinkStep, *, softmax_scale: float, sliding_window: int | None,
               softcap: float | None) -> torch.Tensor:
        """Merge the FP8 part (``[N_fp8, Hq, D]`` and its lse, for ``step.fp8_of_query``) with the
        sink part for the step's N queries ``query [N, Hq, D]``; returns ``[N, Hq, D]``."""
        lay = self.layers[layer_idx]
        N, Hq, D = query.shape
        if out_fp8 is not None and step.fp8_of_query is not None:  # some queries have no FP8 key
            o = query.new_zeros((N, Hq, D))
            lse = torch.full((N, Hq), float("-inf"), dtype=torch.float32, device=query.device)
            o[step.fp8_of_query], lse[step.fp8_of_query] = out_fp8, lse_fp8
            out_fp8, lse_fp8 = o, lse
        if self.transform.sink_tokens == 0:  # centering only: the FP8 part is the whole attention
            return query.new_zeros((N, Hq, D)) if out_fp8 is None else out_fp8
        if lay.means is not None and softcap is not None:
            raise bad_argument("k_centering", f"{self.transform.k_centering!r} with a logit soft-cap",
                               "None (soft-capped logits are not shift-invariant); sink_tokens alone are fine")
        keys = lay.sink_k
        if lay.means is not None:
            if lay.centered is None:
                lay.centered = lay.sink_k.to(torch.float32) - lay.means[:, None]
            keys = lay.centered
        rows = None if step.all_rows else step.rows
        take = (lambda t: t) if rows is None else (lambda t: t[rows])
        return merge_sink_attention(query, out_fp8, lse_fp8, take(keys), take(lay.sink_v),
                                    self._visible(step, sliding_window), None, softmax_scale=softmax_scale,
                                    logits_soft_cap=softcap)

    # -- batch surgery ----------------------------------------------------------------
    def rearrange(self, index: list[int]) -> None:
        """Row ``i`` takes old row ``index[i]``'s sink tokens and means."""
        if not self.sink_lens:
            return
        self.sink_lens = [self.sink_lens[j] for j in index]
        self.mean_set = [self.mean_set[j] for j in index]
        for lay in self.layers:
            for name in ("sink_k", "sink_v", "means"):
                t = getattr(lay, name)
                if t is not None:
                    setattr(lay, name, t[torch.tensor(index, device=t.device)])
            lay.centered = None
        self.step = None

    def check_crop(self, n: int, fp8_lens: list[int]) -> None:
        """A crop of ``n`` tokens may remove FP8 tokens only (sink tokens stay)."""
        short = [b for b, f in enumerate(fp8_lens) if f < n]
        if short:
            b = short[0]
            raise bad_argument("tokens_to_remove", str(-n), f"at most {fp8_lens[b]} (row {b} holds "
                               f"{fp8_lens[b] + self.sink_lens[b]} tokens, {self.sink_lens[b]} of them sink tokens, "
                               "which a crop cannot remove)")

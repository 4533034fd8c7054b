"""``xformers``: ``xformers.ops.memory_efficient_attention`` (xFormers, Lefaudeux et al., 2022).

Exact softmax attention in the memory-efficient form of Rabe & Staats (2021) ("Self-attention Does
Not Need O(n^2) Memory"), run by a fused CUDA operator of xFormers: the one its dispatcher picks
(``op=auto``) or one family forced with the ``op`` knob: ``cutlass`` (``cutlassF-pt``: PyTorch's own
memory-efficient kernel, the one SDPA also has), ``flash`` (FlashAttention 2; ``fa2F@...-pt`` is
PyTorch's built-in copy when the ``flash_attn`` package is absent), ``flash3`` (FlashAttention 3, from
xFormers' compiled extension), ``triton_splitk`` (split-K flash-decoding in Triton, forward only) or
``ck`` (AMD's Composable Kernel). :attr:`XFormersAttention.op_ran` names the forward operator that ran
(``op_bw_ran`` the backward one), for records.

xFormers wants ``(B, N, H, D)``: inputs are transposed in (a view, no copy) and the output back.
Grouped K/V heads (GQA) are passed in xFormers' 5-D layout ``(B, N, G, H/G, D)`` with K and V
expanded over each group (a view, no copy) when no gradient is needed (xFormers' grouped layout is
forward-only); with a gradient they are repeated (a copy). ``gqa_layout`` in the record says which.

Masks become an xFormers attention bias, a type where xFormers has one, a dense tensor only where it
has none (``bias_kind`` in the record names which; a dense ``(B, H, Nq, Nk)`` bias costs ``O(N^2)``
memory and shows in the memory column):

- causal alone: ``LowerTriangularMask`` (``Nq == Nk``), ``LowerTriangularFromBottomRightMask``
  (``Nq < Nk``: the queries are the last positions), nothing for one query (it sees every key);
- a window ``w`` (the ``window`` knob, or a model's sliding window; the narrower of the two), in
  local_window's convention (the query at position ``p`` sees key ``j`` iff ``|p - j| <= w``):
  ``LowerTriangularFromBottomRightLocalAttentionMask(w + 1)`` when causal (xFormers counts the
  keys a query sees, the query's own included), ``LocalAttentionFromBottomRightMask(w, w)`` when not;
- a key padding mask or an ``attn_mask`` (or a typed bias the chosen operator does not take): a
  dense additive float tensor (0 = may attend, -inf = may not; causal and window folded in) kept at
  its broadcast shape, e.g. ``(B, 1, 1, Nk)`` for key padding, expanded (a view) to the
  ``(B, H, Nq, Nk)`` xFormers checks. A query row that sees no key is given key 0 and zeroed
  afterwards, which also zeroes its gradients (the kernel would give NaN otherwise).

Head sizes that are not a multiple of 8 are zero-padded (the CUDA kernels need 8-element alignment;
the scale stays ``1/sqrt(D)``).

Time ``O(B H Nq Nk D)`` (``O(B H Nq w D)`` with a window, for operators that skip masked tiles);
memory ``O(B H N D)`` plus a dense bias when one is used.

xFormers is imported lazily (never when ``variants`` is imported) with its import-time warning
silenced. Whether it runs is decided by real calls (:func:`probe`: can the operator run a plain
fp16 call here at all, then in the job's dtype), not by whether its compiled extension loaded. The
record's ``xformers_extension`` says whether the extension loaded (and if not, what it was built
for). Not installed, not importable, or with no operator that runs a plain call on this machine it is
:class:`Unavailable`, in xFormers' words; an operator that runs but not in this dtype is
:class:`Unsupported`; on the CPU it is :class:`Unsupported` (xFormers has no CPU operator).

xFormers' gate: its ``cutlass`` and ``flash`` operators call PyTorch's own kernels and
``triton_splitk`` is Triton, so they need no compiled extension of xFormers' own; but every operator
refuses ("xFormers wasn't build with CUDA support") when the build's CUDA version is unknown, and it is
read from that extension: with an xFormers built for another torch nothing runs (seen on an H200 with
xFormers 0.0.35 for torch 2.10 and torch 2.11). ``lift_gate=true`` sets the gate for the process
(:func:`lift_cuda_gate`; the record says so), and then those operators run (the same H200: cutlass,
flash and split-K within bf16 rounding of the float64 reference).
"""

from __future__ import annotations

import contextlib
import logging
import re
import warnings
from collections.abc import Iterator
from types import ModuleType
from typing import Any, ClassVar

import torch
import torch.nn.functional as F

from .base import AttentionVariant, Unavailable, Unsupported, Workload, repeat_kv
from .patterns import band_pairs, band_pattern
from .registry import register

#: xFormers' kernels run on CUDA GPUs only: installing it on a CPU-only machine would give nothing
INSTALL_HINT = "on a CUDA machine, pip install 'attnbench[xformers]' (it runs on GPUs only)"
_ALIGN = 8  # CUDA kernels want head sizes and bias rows aligned to 8 elements (16 bytes in fp16)


@contextlib.contextmanager
def quiet_xformers() -> Iterator[None]:
    """Silence xFormers' ``logging`` warnings and Python warnings for the duration of the block.

    xFormers logs a multi-line warning at import when its C++ extensions don't load and may log more
    on first use; the reason is reported in :class:`Unsupported` instead.
    """
    logger = logging.getLogger("xformers")
    old = logger.level
    logger.setLevel(logging.ERROR)
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            yield
    finally:
        logger.setLevel(old)


_XOPS: ModuleType | None = None
_IMPORT_ERROR: str | None = None


def load_xformers() -> ModuleType:
    """``xformers.ops``, imported once and quietly; :class:`Unavailable` if it cannot be imported."""
    global _XOPS, _IMPORT_ERROR
    if _XOPS is not None:
        return _XOPS
    if _IMPORT_ERROR is not None:
        raise Unavailable(_IMPORT_ERROR)
    try:
        with quiet_xformers():
            import xformers.ops as xops
    except ImportError:
        _IMPORT_ERROR = f"xformers is not installed: {INSTALL_HINT}"
        raise Unavailable(_IMPORT_ERROR) from None
    except Exception as exc:  # a broken install must read as unavailable, not crash a sweep
        _IMPORT_ERROR = f"xformers could not be imported ({type(exc).__name__}: {_first_line(exc)})"
        raise Unavailable(_IMPORT_ERROR) from None
    _XOPS = xops
    return xops


def _first_line(exc: BaseException) -> str:
    text = str(exc).strip()
    return text.splitlines()[0] if text else type(exc).__name__


def summarize_not_implemented(msg: str) -> str:
    """One readable line from xFormers' multi-line "No operator found" message.

    Keeps its first line and, per operator it tried, the reasons it gave (inputs table dropped).
    """
    lines = msg.strip().splitlines()
    if not lines:
        return "no reason given"
    head = lines[0].rstrip(":").replace(" with inputs", "")
    parts: list[str] = []
    op: str | None = None
    reasons: list[str] = []
    for line in lines[1:]:
        m = re.match(r"\s*`(.+)` is not supported because:", line)
        if m:
            if op is not None:
                parts.append(f"{op}: {'; '.join(reasons)}")
            op, reasons = m.group(1), []
        elif op is not None and line.strip():
            reasons.append(line.strip())
    if op is not None:
        parts.append(f"{op}: {'; '.join(reasons)}")
    return f"{head} ({' | '.join(parts)})" if parts else head


def _extension_note() -> str:
    """``"; " +`` why xFormers' compiled extension did not load (:func:`extension_failure`), or ``""``."""
    failure = extension_failure()
    return "" if failure is None else f"; {failure}"


def extension_failure() -> str | None:
    """Why xFormers' compiled extensions did not load, naming what they were built for, or None.

    One line, e.g. "xformers 0.0.35 cannot load its compiled kernels: built for torch 2.10.0+cu128
    (CUDA 12.8), this is torch 2.11.0+cu130; install the xformers release built for this torch".
    """
    try:
        from xformers import _cpp_lib  # private: only read to explain a failure
    except Exception:
        return None
    exc = getattr(_cpp_lib, "_cpp_library_load_exception", None)
    if exc is None:
        return None
    from importlib import metadata

    try:
        version = metadata.version("xformers")
    except metadata.PackageNotFoundError:
        version = "?"
    info = getattr(exc, "build_info", None)
    if info is None:
        built = f"{type(exc).__name__}: {_first_line(exc)}"
    else:
        cuda = info.cuda_version
        # xFormers writes CUDA 12.8 as 1208
        cuda_text = f" (CUDA {cuda // 100}.{cuda % 100})" if isinstance(cuda, int) else ""
        built = f"built for torch {info.torch_version}{cuda_text}"
    return (
        f"xformers {version} cannot load its compiled kernels: {built}, this is torch {torch.__version__}; "
        "install the xformers release built for this torch (or the torch it was built for)"
    )


#: the operator families the ``op`` knob can force (modules of ``xformers.ops.fmha``); ``auto``: the
#: dispatcher's choice
OPS = ("auto", "cutlass", "flash", "flash3", "triton_splitk", "ck")


def operators(xops: ModuleType, op: str) -> tuple[Any, Any]:
    """``(FwOp, BwOp)`` of the operator family ``op`` (``BwOp`` None if it has no backward), or
    ``(None, None)`` for ``auto``; :class:`Unavailable` if this xFormers has no such family."""
    if op == "auto":
        return None, None
    family = getattr(xops.fmha, op, None)
    if family is None or not hasattr(family, "FwOp"):
        raise Unavailable(f"this xformers has no operator family '{op}' (xformers.ops.fmha.{op})")
    return family.FwOp, getattr(family, "BwOp", None)


_PROBED: dict[tuple, str | None] = {}


_PROBE_HEAD = 64  # a head size every operator family takes (split-K refuses 8)


def probe_input(device: str, dtype: torch.dtype) -> torch.Tensor:
    """The probe's query, key and value: ``(1, 8, 1, 64)`` (B, N, H, D) on ``device``."""
    return torch.zeros(1, 8, 1, _PROBE_HEAD, device=device, dtype=dtype)


#: the words of xFormers' gate: every CUDA operator refuses when the build's CUDA version is unknown,
#: which is the case whenever its compiled extension did not load (the version is read from it)
GATE_WORDS = "xFormers wasn't build with CUDA support"
GATE_HINT = (
    "xFormers refuses every CUDA operator when its compiled extension did not load, also those that "
    "call PyTorch's own kernels (cutlass, flash) or Triton (triton_splitk); variant.lift_gate=true "
    "lets those run"
)


def lift_cuda_gate(xops: ModuleType) -> bool:
    """Let xFormers' operators that need no compiled extension of its own run when that extension did
    not load: sets ``xformers.ops.fmha.common._built_with_cuda`` (private; read by every operator's
    ``not_supported_reasons``, forward and backward) for the rest of the process. Operators that do
    need the extension (flash3, ck) still refuse with "operator wasn't built". True if it was lifted
    now or before."""
    common = getattr(getattr(xops, "fmha", None), "common", None)
    if common is None or not hasattr(common, "_built_with_cuda"):
        return False
    common._built_with_cuda = True  # the process's other xFormers calls see it too (said in the record)
    return True


def probe(device: str, dtype: torch.dtype, op: str = "auto") -> str | None:
    """Why xFormers cannot run on ``(device, dtype)`` with operator family ``op`` (its own words), or
    None if a tiny call works. Cached per ``(device, dtype, op)`` and state of xFormers' CUDA gate; the
    call is forward only, on :func:`probe_input`."""
    xops = load_xformers()
    common = getattr(getattr(xops, "fmha", None), "common", None)
    key = (device, dtype, op, getattr(common, "_built_with_cuda", None))  # the gate may be lifted since
    if key not in _PROBED:
        fw, _ = operators(xops, op)
        x = probe_input(device, dtype)  # (B, N, H, D)
        try:
            with quiet_xformers():
                xops.memory_efficient_attention_forward(x, x, x, op=fw)
            _PROBED[key] = None
        except NotImplementedError as exc:  # the dispatcher found no operator
            _PROBED[key] = summarize_not_implemented(str(exc))
        except ValueError as exc:  # a forced operator refused: its reasons, in the same layout
            _PROBED[key] = summarize_not_implemented(str(exc))
        except RuntimeError as exc:
            _PROBED[key] = f"{type(exc).__name__}: {_first_line(exc)}"
    return _PROBED[key]


def additive_bias(
    batch: int,
    heads: int,
    nq: int,
    nk: int,
    *,
    causal: bool,
    key_padding_mask: torch.Tensor | None,
    attn_mask: torch.Tensor | None,
    dtype: torch.dtype,
    device: torch.device | str,
    window: int | None = None,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Dense additive bias for xFormers and the rows that see no key.

    Returns ``(bias, empty)``: ``bias`` is ``(B, H, Nq, Nk)`` (an expanded view of a tensor of the
    masks' broadcast shape, rows aligned to 8 elements) holding 0 where attending is allowed and -inf
    elsewhere, except that a row with no allowed key gets 0 at key 0 (so the kernel never sees an
    all -inf row); ``empty`` (broadcastable to ``(B, H, Nq, 1)``, True = zero that row) or None.
    Causal and ``window`` (``|p - j| <= window``, ``p = i + Nk - Nq``) are folded in.
    """
    allowed = torch.ones(1, 1, 1, nk, dtype=torch.bool, device=device)  # (1, 1, 1, Nk)
    if key_padding_mask is not None:
        allowed = key_padding_mask.to(device)[:, None, None, :]  # (B, 1, 1, Nk)
    if attn_mask is not None:
        am = attn_mask.to(device)
        while am.dim() < 4:
            am = am.unsqueeze(0)  # (B|1, H|1, Nq|1, Nk)
        allowed = allowed & am
    # folded in (bottom-right: query i is position i + Nk - Nq): a typed mask cannot be combined with
    # the empty-row fix below
    if window is not None:
        allowed = allowed & band_pattern(nq, nk, window, causal).to(device)  # (.., Nq, Nk)
    elif causal:
        allowed = allowed & torch.ones(nq, nk, dtype=torch.bool, device=device).tril(nk - nq)  # (.., Nq, Nk)
    empty = ~allowed.any(dim=-1, keepdim=True)  # (B|1, H|1, Nq|1, 1)
    # off the CPU applied without counting: a host read would stall the stream every call and cannot be
    # captured in a CUDA graph (as masks.additive_mask)
    has_empty = torch.device(device).type != "cpu" or bool(empty.any())
    if has_empty:
        first = torch.zeros(nk, dtype=torch.bool, device=device)
        first[0] = True
        allowed = allowed | (empty & first)
    shape = allowed.shape[:-1]
    nk_pad = -(-nk // _ALIGN) * _ALIGN
    # allocate aligned rows and slice: xFormers checks every stride but the last is a multiple of 8
    bias = torch.zeros(*shape, nk_pad, dtype=dtype, device=device)[..., :nk]  # (B|1, H|1, Nq|1, Nk)
    bias.masked_fill_(~allowed, float("-inf"))
    return bias.expand(batch, heads, nq, nk), (empty if has_empty else None)


def typed_bias(xops: ModuleType, nq: int, nk: int, *, causal: bool, window: int | None) -> Any:
    """xFormers' own bias type for causal and/or a window (bottom-right aligned), or None for none.

    The window is local_window's radius ``w`` (``|p - j| <= w``): causal, xFormers counts the ``w + 1``
    keys a query sees, its own included; both sides, ``w`` keys left and ``w`` right.
    """
    ab = xops.fmha.attn_bias
    if window is not None and window < nk - 1:  # a window this wide or wider hides no key
        if causal:
            return ab.LowerTriangularFromBottomRightLocalAttentionMask(window + 1)
        return ab.LocalAttentionFromBottomRightMask(window_left=window, window_right=window)
    if not causal or nq == 1:  # one query (the last position) sees every key
        return None
    return ab.LowerTriangularMask() if nq == nk else ab.LowerTriangularFromBottomRightMask()


def bias_kind(bias: Any) -> str:
    """How a bias reads in a record: ``none``, the xFormers type's name, or ``dense (shape)``."""
    if bias is None:
        return "none"
    if isinstance(bias, torch.Tensor):
        return f"dense {tuple(bias.shape)}"
    return type(bias).__name__


@register("xformers")
class XFormersAttention(AttentionVariant):
    """xFormers' ``memory_efficient_attention`` (CUDA only); :attr:`op_ran` names the operator."""

    devices = frozenset({"cuda"})
    dtypes = frozenset({torch.float32, torch.float16, torch.bfloat16})
    backward_devices = frozenset({"cuda"})
    native_scale = True
    native_gqa = True  # xFormers' grouped 5-D layout (forward), or repeated K/V (backward)
    native_window = True  # xFormers' local attention masks; the narrower of the knob and a call's
    # lift_gate: on a GPU whose torch the installed xFormers was not built for, the registry-wide
    # tests still run its PyTorch-backed operators
    example_knobs = ({"window": 3, "lift_gate": True}, {"op": "cutlass", "lift_gate": True})

    #: set after each call: the forward / backward operator that ran
    op_ran: str | None
    op_bw_ran: str | None
    _dispatch_cache: ClassVar[dict[tuple, tuple[str, str | None]]] = {}

    def __init__(self, op: str = "auto", window: int | None = None, lift_gate: bool = False) -> None:
        super().__init__()
        if op not in OPS:
            raise ValueError(f"xformers op must be one of {', '.join(OPS)}; got '{op}'")
        if window is not None and (isinstance(window, bool) or not isinstance(window, int) or window < 0):
            raise ValueError(f"window must be an integer >= 0 (a radius in tokens) or None, got {window!r}")
        if not isinstance(lift_gate, bool):
            raise ValueError(f"lift_gate must be true or false, got {lift_gate!r}")
        self.op = op
        self.window = window
        self.lift_gate = lift_gate
        self.op_ran = None
        self.op_bw_ran = None
        self.bias_kind: str | None = None
        self.gqa_layout: str | None = None
        self.extension: str | None = None

        # with a window it computes local_window's band, an approximation of full attention
        self.exact = window is None

    def knobs(self) -> dict[str, object]:
        return {"op": self.op, "window": self.window, "lift_gate": self.lift_gate}

    def pattern(self, nq: int, nk: int, causal: bool = False) -> torch.Tensor:
        """Every pair (bottom-right causal), or local_window's band with the ``window`` knob."""
        if self.window is None:
            return super().pattern(nq, nk, causal)
        return band_pattern(nq, nk, self.window, causal)

    def num_pairs(self, nq: int, nk: int, causal: bool = False) -> int:
        if self.window is None:
            return super().num_pairs(nq, nk, causal)
        return band_pairs(nq, nk, self.window, causal)

    def check(self, w: Workload) -> None:
        if w.device not in self.devices:  # a fact about the variant, whatever is installed
            # no install hint and no note on the extension: neither would make it run here
            reason = (
                f"xFormers has no {w.device.upper()} operator (memory_efficient_attention runs on CUDA GPUs)"
            )
            try:
                said = probe(w.device, w.dtype)
                reason += f"; xFormers says: {said}" if said else ""
            except Unavailable:
                pass  # not installed
            raise Unsupported(f"xformers does not run on device '{w.device}': {reason}")
        xops = load_xformers()
        fw, bw = operators(xops, self.op)
        super().check(w)
        if w.backward and fw is not None and bw is None:
            raise Unsupported(f"xformers op={self.op} has no backward operator (forward only: decoding)")
        failure = extension_failure()
        lifted = failure is not None and self.lift_gate and lift_cuda_gate(xops)
        # decided by real calls: can the operator(s) run at all here (fp16, which every family
        # takes), then in this dtype
        who = "xformers" if self.op == "auto" else f"xformers op={self.op}"
        reason = probe(w.device, torch.float16, self.op)
        if reason is not None:
            reason += _extension_note()
            if GATE_WORDS in reason:
                reason += f"; {GATE_HINT}"
            raise Unavailable(f"{who} cannot run on this machine: {reason}")
        reason = probe(w.device, w.dtype, self.op)
        if reason is not None:
            raise Unsupported(f"{who} cannot run {str(w.dtype).replace('torch.', '')}: {reason}")
        self.extension = "loaded" if failure is None else f"not loaded: {failure}"
        if lifted:
            self.extension += "; xFormers' CUDA gate lifted for this process (lift_gate=true)"

    def _attend(self, q, k, v, *, causal, key_padding_mask, attn_mask, scale=None, window=None):
        xops = load_xformers()
        b, h, nq, d = q.shape
        hkv, nk, dv = k.shape[1], k.shape[2], v.shape[3]
        window = min((r for r in (window, self.window) if r is not None), default=None)  # the narrower
        needs_grad = torch.is_grad_enabled() and any(t.requires_grad for t in (q, k, v))
        fw, bw = operators(xops, self.op)
        if needs_grad and fw is not None and bw is None:
            raise Unsupported(f"xformers op={self.op} has no backward operator (forward only: decoding)")
        # zero-pad unaligned head sizes: q.k and p.v are unchanged, the padded output columns dropped
        if d % _ALIGN:
            q = F.pad(q, (0, _ALIGN - d % _ALIGN))  # (B, H, Nq, Dp)
            k = F.pad(k, (0, _ALIGN - d % _ALIGN))  # (B, Hkv, Nk, Dp)
        if dv % _ALIGN:
            v = F.pad(v, (0, _ALIGN - dv % _ALIGN))  # (B, Hkv, Nk, Dvp)
        grouped = hkv != h and not needs_grad  # xFormers' 5-D grouped layout has no backward
        if hkv != h and not grouped:
            k, v = repeat_kv(k, h), repeat_kv(v, h)  # (B, H, Nk, Dp|Dvp): a copy
        qx = q.transpose(1, 2)  # (B, Nq, H, Dp): xFormers' layout, a view with stride(-1) == 1
        kx = k.transpose(1, 2)  # (B, Nk, Hkv|H, Dp)
        vx = v.transpose(1, 2)  # (B, Nk, Hkv|H, Dvp)
        if grouped:
            g = h // hkv
            qx = qx.unflatten(2, (hkv, g))  # (B, Nq, Hkv, G, Dp): query head h in group h // G
            kx = kx[:, :, :, None].expand(b, nk, hkv, g, kx.shape[-1])  # (B, Nk, Hkv, G, Dp), a view
            vx = vx[:, :, :, None].expand(b, nk, hkv, g, vx.shape[-1])  # (B, Nk, Hkv, G, Dvp), a view
        self.gqa_layout = None if hkv == h else ("grouped 5-D" if grouped else "repeated")
        scale = d**-0.5 if scale is None else scale  # of the true head size, not the padded one

        empty = None
        dense = key_padding_mask is not None or attn_mask is not None
        bias: Any = None if dense else typed_bias(xops, nq, nk, causal=causal, window=window)
        refusal = None if dense else self._choose(xops, fw, bw, qx, kx, vx, bias, scale, needs_grad)
        if refusal is not None and bias is not None:  # no operator takes the type: a dense tensor
            dense = True
        if dense:
            bias, empty = additive_bias(
                b,
                h,
                nq,
                nk,
                causal=causal,
                key_padding_mask=key_padding_mask,
                attn_mask=attn_mask,
                dtype=q.dtype,
                device=q.device,
                window=window,
            )  # (B, H, Nq, Nk)
            if grouped:
                bias = bias.unflatten(1, (hkv, h // hkv))  # (B, Hkv, G, Nq, Nk), a view
            refusal = self._choose(xops, fw, bw, qx, kx, vx, bias, scale, needs_grad)
        if refusal is not None:
            raise Unsupported(
                f"xformers{'' if fw is None else f' op={self.op}'} cannot run this input: {refusal}"
            )
        self.bias_kind = bias_kind(bias)
        try:
            with quiet_xformers():
                op = None if fw is None else (fw, bw)
                out = xops.memory_efficient_attention(qx, kx, vx, attn_bias=bias, scale=scale, op=op)
        except (NotImplementedError, ValueError) as exc:
            raise Unsupported(
                f"xformers cannot run this input: {summarize_not_implemented(str(exc))}"
            ) from None
        if grouped:
            out = out.flatten(2, 3)  # (B, Nq, Hkv, G, Dvp) -> (B, Nq, H, Dvp)
        out = out.transpose(1, 2)[..., :dv]  # (B, Nq, H, Dvp) -> (B, H, Nq, Dv)
        if empty is not None:
            out = out.masked_fill(empty, 0.0)  # rows that see no key: zeros, and zero gradients
        return out

    def _choose(
        self,
        xops: ModuleType,
        fw: Any,
        bw: Any,
        qx: torch.Tensor,
        kx: torch.Tensor,
        vx: torch.Tensor,
        bias: Any,
        scale: float,
        grad: bool,
    ) -> str | None:
        """Set :attr:`op_ran` / :attr:`op_bw_ran` to the operators that take these inputs (the
        dispatcher's, or the forced family's); return why none does (one line), or None.
        Cached per layout."""
        key = (
            self.op,
            *(tuple(t.shape) + t.stride() for t in (qx, kx, vx)),
            qx.dtype,
            str(qx.device),
            type(bias).__name__,
            None if not isinstance(bias, torch.Tensor) else bias.stride(),
            grad,
        )
        hit = self._dispatch_cache.get(key)
        if hit is None:
            try:  # private API: if it moves, the record says so rather than the call failing
                fmha = xops.fmha
                inp = fmha.common.Inputs(query=qx, key=kx, value=vx, attn_bias=bias, scale=scale)
                with quiet_xformers():
                    if fw is None:
                        f = fmha.dispatch._dispatch_fw(inp, grad).NAME
                        b = fmha.dispatch._dispatch_bw(inp, varlen_lse_packed=None).NAME if grad else None
                    else:
                        reasons = [f"{fw.NAME}: {r}" for r in fw.not_supported_reasons(inp)]
                        if grad:
                            reasons += [f"{bw.NAME}: {r}" for r in bw.not_supported_reasons(inp)]
                        if reasons:
                            return "; ".join(" ".join(r.split()) for r in reasons)
                        f, b = fw.NAME, bw.NAME if grad else None
                hit = (f, b)
            except NotImplementedError as exc:
                return summarize_not_implemented(str(exc))
            except Exception as exc:
                hit = (f"unknown ({type(exc).__name__} from xformers' dispatcher)", None)
            self._dispatch_cache[key] = hit
        self.op_ran, self.op_bw_ran = hit
        return None

    def describe(self) -> dict[str, object]:
        d = super().describe()
        d["op_ran"] = self.op_ran
        d["op_bw_ran"] = self.op_bw_ran
        d["bias_kind"] = self.bias_kind
        d["gqa_layout"] = self.gqa_layout
        d["xformers_extension"] = self.extension
        return d

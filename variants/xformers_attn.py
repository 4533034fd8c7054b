"""``xformers``: ``xformers.ops.memory_efficient_attention`` (xFormers, Lefaudeux et al., 2022).

Exact softmax attention in the memory-efficient form of Rabe & Staats (2021) ("Self-attention Does
Not Need O(n^2) Memory"), run by whichever fused CUDA operator xFormers' dispatcher picks
(FlashAttention 2/3 or the CUTLASS kernel; ``cutlassF-pt`` is the same kernel as SDPA's
memory-efficient backend). :attr:`XFormersAttention.op_ran` names the forward operator that ran
(``op_bw_ran`` the backward one), for records.

xFormers wants ``(B, N, H, D)``: inputs are transposed in (a view, no copy) and the output back.
Masks become an xFormers attention bias: ``LowerTriangularMask`` for causal alone; with a key padding
mask or an ``attn_mask``, a dense additive float tensor (0 = may attend, -inf = may not; causal folded
in) kept at its broadcast shape, e.g. ``(B, 1, 1, Nk)`` for key padding, and expanded (a view) to the
``(B, H, Nq, Nk)`` xFormers checks. A query row that sees no key is given key 0 and zeroed afterwards,
which also zeroes its gradients (the kernel would give NaN otherwise). Head sizes that are not a
multiple of 8 are zero-padded (the CUDA kernels need 8-element alignment; the scale stays
``1/sqrt(D)``).

Time ``O(B H Nq Nk D)``; memory ``O(B H N D)`` plus the bias (``O(B Nk)`` for key padding,
``O(B H Nq Nk)`` for a full ``attn_mask`` or key padding with causal).

xFormers is imported lazily (never when ``variants`` is imported) with its import-time warning
silenced. Not installed, not importable, or installed with compiled extensions that do not load
(xFormers wheels are built for one torch release: 0.0.35 for torch 2.10 with CUDA 12.8) it is
:class:`Unavailable`, naming the versions it was built for; on the CPU it is :class:`Unsupported`
(its kernels are CUDA-only), with the reason xFormers itself gives.
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

from .base import AttentionVariant, Unavailable, Unsupported, Workload
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
    """Why xFormers' compiled extensions did not load, if they did not (first two lines)."""
    try:
        from xformers import _cpp_lib  # private, only used to explain a refusal
    except Exception:
        return ""
    exc = getattr(_cpp_lib, "_cpp_library_load_exception", None)
    if exc is None:
        return ""
    lines = [s.strip() for s in str(exc).strip().splitlines()[:2]]
    return "; note: " + " ".join(lines)


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


_PROBED: dict[tuple[str, torch.dtype], str | None] = {}


def probe(device: str, dtype: torch.dtype) -> str | None:
    """Why xFormers cannot run on ``(device, dtype)`` (its own words), or None if a tiny call works.

    Cached per ``(device, dtype)``; the call is on a ``(1, 8, 1, 8)`` input.
    """
    key = (device, dtype)
    if key not in _PROBED:
        xops = load_xformers()
        x = torch.zeros(1, 8, 1, _ALIGN, device=device, dtype=dtype)  # (B, N, H, D)
        try:
            with quiet_xformers():
                xops.memory_efficient_attention_forward(x, x, x)
            _PROBED[key] = None
        except NotImplementedError as exc:
            _PROBED[key] = summarize_not_implemented(str(exc)) + _extension_note()
        except (RuntimeError, ValueError) as exc:
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
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Dense additive bias for xFormers and the rows that see no key.

    Returns ``(bias, empty)``: ``bias`` is ``(B, H, Nq, Nk)`` (an expanded view of a tensor of the
    masks' broadcast shape, rows aligned to 8 elements) holding 0 where attending is allowed and -inf
    elsewhere, except that a row with no allowed key gets 0 at key 0 (so the kernel never sees an
    all -inf row); ``empty`` (broadcastable to ``(B, H, Nq, 1)``, True = zero that row) or None.
    At least one of ``key_padding_mask`` / ``attn_mask`` must be given.
    """
    allowed: torch.Tensor | None = None
    if key_padding_mask is not None:
        allowed = key_padding_mask.to(device)[:, None, None, :]  # (B, 1, 1, Nk)
    if attn_mask is not None:
        am = attn_mask.to(device)
        while am.dim() < 4:
            am = am.unsqueeze(0)  # (B|1, H|1, Nq|1, Nk)
        allowed = am if allowed is None else allowed & am
    if allowed is None:
        raise ValueError("additive_bias needs a key_padding_mask or an attn_mask")
    if causal:  # folded in: LowerTriangularMask cannot be combined with the empty-row fix below
        # bottom-right: query i is position i + Nk - Nq
        allowed = allowed & torch.ones(nq, nk, dtype=torch.bool, device=device).tril(nk - nq)  # (.., Nq, Nk)
    empty = ~allowed.any(dim=-1, keepdim=True)  # (B|1, H|1, Nq|1, 1)
    has_empty = bool(empty.any())
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


@register("xformers")
class XFormersAttention(AttentionVariant):
    """xFormers' ``memory_efficient_attention`` (CUDA only); :attr:`op_ran` names the operator."""

    devices = frozenset({"cuda"})
    dtypes = frozenset({torch.float32, torch.float16, torch.bfloat16})
    backward_devices = frozenset({"cuda"})
    native_scale = True

    #: set after each call: the forward / backward operator xFormers' dispatcher chose
    op_ran: str | None
    op_bw_ran: str | None
    _dispatch_cache: ClassVar[dict[tuple, tuple[str, str | None]]] = {}

    def __init__(self) -> None:
        super().__init__()
        self.op_ran = None
        self.op_bw_ran = None

    def check(self, w: Workload) -> None:
        if w.device not in self.devices:  # a fact about the variant, whatever is installed
            try:
                reason = (
                    probe(w.device, w.dtype)
                    or "not declared for this device (this suite runs it on cuda only)"
                )
            except Unavailable:  # not installed: no install hint where installing would not help
                where = w.device.upper()
                reason = f"xFormers has no {where} operator (memory_efficient_attention runs on CUDA GPUs)"
            raise Unsupported(f"xformers does not run on device '{w.device}': {reason}")
        load_xformers()
        failure = extension_failure()
        if failure is not None:
            raise Unavailable(failure)
        super().check(w)
        reason = probe(w.device, w.dtype)
        if reason is not None:
            raise Unsupported(f"xformers cannot run {str(w.dtype).replace('torch.', '')}: {reason}")

    def _attend(self, q, k, v, *, causal, key_padding_mask, attn_mask, scale=None):
        xops = load_xformers()
        b, h, nq, d = q.shape
        nk, dv = k.shape[2], v.shape[3]
        empty = None
        bias: Any = None
        if key_padding_mask is not None or attn_mask is not None:
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
            )  # (B, H, Nq, Nk)
        elif causal and nq == nk:
            bias = xops.fmha.attn_bias.LowerTriangularMask()
        elif causal and nq > 1:  # Nq < Nk: the queries are the last positions
            bias = xops.fmha.attn_bias.LowerTriangularFromBottomRightMask()
        # zero-pad unaligned head sizes: q.k and p.v are unchanged, the padded output columns dropped
        if d % _ALIGN:
            q = F.pad(q, (0, _ALIGN - d % _ALIGN))  # (B, H, Nq, Dp)
            k = F.pad(k, (0, _ALIGN - d % _ALIGN))  # (B, H, Nk, Dp)
        if dv % _ALIGN:
            v = F.pad(v, (0, _ALIGN - dv % _ALIGN))  # (B, H, Nk, Dvp)
        qx = q.transpose(1, 2)  # (B, Nq, H, Dp): xFormers' layout, a view with stride(-1) == 1
        kx = k.transpose(1, 2)  # (B, Nk, H, Dp)
        vx = v.transpose(1, 2)  # (B, Nk, H, Dvp)
        needs_grad = torch.is_grad_enabled() and any(t.requires_grad for t in (q, k, v))
        scale = d**-0.5 if scale is None else scale  # of the true head size, not the padded one
        self._record_ops(xops, qx, kx, vx, bias, scale, needs_grad)
        try:
            with quiet_xformers():
                out = xops.memory_efficient_attention(qx, kx, vx, attn_bias=bias, scale=scale)
        except NotImplementedError as exc:
            raise Unsupported(
                f"xformers cannot run this input: {summarize_not_implemented(str(exc))}"
            ) from None
        out = out.transpose(1, 2)[..., :dv]  # (B, Nq, H, Dvp) -> (B, H, Nq, Dv)
        if empty is not None:
            out = out.masked_fill(empty, 0.0)  # rows that see no key: zeros, and zero gradients
        return out

    def _record_ops(
        self,
        xops: ModuleType,
        qx: torch.Tensor,
        kx: torch.Tensor,
        vx: torch.Tensor,
        bias: Any,
        scale: float,
        grad: bool,
    ) -> None:
        """Ask xFormers' dispatcher which operators it picks for these inputs (cached per layout)."""
        key = (
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
                    fw = fmha.dispatch._dispatch_fw(inp, grad).NAME
                    bw = fmha.dispatch._dispatch_bw(inp, varlen_lse_packed=None).NAME if grad else None
                hit = (fw, bw)
            except NotImplementedError:
                return  # the call itself raises, with xFormers' reason
            except Exception as exc:
                hit = (f"unknown ({type(exc).__name__} from xformers' dispatcher)", None)
            self._dispatch_cache[key] = hit
        self.op_ran, self.op_bw_ran = hit

    def describe(self) -> dict[str, object]:
        d = super().describe()
        d["op_ran"] = self.op_ran
        d["op_bw_ran"] = self.op_bw_ran
        return d

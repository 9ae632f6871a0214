"""Fused CPU kernels of the eager pass: one streaming loop per block instead of a dozen ATen
operations (``kernels.c``).

On CPU the ATen pass spends its time in ~25 separate sweeps over each block (every operation
reads and writes whole (B, T) temporaries); these kernels compute the same per-token values and
per-row reductions in one sweep. They are built from source with the system C compiler on first
use (about a second) and cached on disk, so installing the package needs no compiler; where
none is available the ATen pass runs, with the same results up to float32 rounding.

Control with the environment variable ``ROLLOUT_CORRECTION_NATIVE``:

* unset or ``auto`` — use the kernels when they build, else the ATen pass (logged once at INFO);
* ``0`` — never use them (the ATen pass, bit for bit as without this module);
* ``1`` — require them: a failed build raises instead of falling back.

The build cache is ``$ROLLOUT_CORRECTION_CACHE`` (default ``~/.cache/rollout_correction``, else a
per-user folder in the temporary directory); a library is loaded only from a file and folder that
belong to the user and that nobody else can write. The compiler is ``$CC`` (default ``cc``), and
the library is specific to this machine's CPU (``-march=native``; the cache key includes the
compiler, its flags and the CPU's feature flags). Rows are split over PyTorch's OpenMP pool
(``torch.get_num_threads()``). :func:`status` says what happened; ``rollout-correction native``
builds ahead.

Exactness: every token goes through the same vector code whatever its position in a block and
every row sum is taken in an order fixed by the row's length, so results do not depend on the
block size or the number of threads (see ``kernels.c``). ``exp`` is a polynomial of relative
error below 2 ulp rather than the libm/SLEEF routine behind ``torch.exp``, so a weight may differ
from the ATen pass's in its last bit.
"""

from __future__ import annotations

import ctypes
import getpass
import hashlib
import logging
import os
import platform
import shutil
import subprocess
import tempfile
import threading
from importlib import resources
from pathlib import Path
from typing import Optional

import torch

__all__ = ["ENV", "CACHE_ENV", "mode", "library", "status", "enabled_for", "fused_pass", "band", "PASS_ROWS",
           "BAND_ROWS", "MODES"]

log = logging.getLogger(__name__)

ENV = "ROLLOUT_CORRECTION_NATIVE"
CACHE_ENV = "ROLLOUT_CORRECTION_CACHE"
FLAGS = ("-O3", "-ffp-contract=off", "-fno-math-errno", "-fno-trapping-math", "-fPIC", "-shared", "-pthread")
#: Flags tried after FLAGS, best first: the machine's own instruction set and OpenMP, then without
#: OpenMP (rows split over POSIX threads), then for the generic target.
VARIANTS = (("-march=native", "-fopenmp"), ("-march=native",), ("-fopenmp",), ())
#: Rows of the (NSUM, B) float32 matrix ``fused_pass`` returns (order of ``kernels.c``).
PASS_ROWS = ("input_mask", "mask", "log_ratio", "old", "k3", "ratio", "ratio2", "log_ratio_clamped", "k2",
             "k2_max", "k3_max")
#: Rows of the (NSTAT, B) float64 matrix ``band`` returns.
BAND_ROWS = ("sum", "sum2", "max", "min", "high", "low", "zsum", "zsum2")
#: What ``band`` writes (see ``kernels.c``).
MODES = {"keep": 1, "truncate": 2, "clip": 3, "mask": 4}
#: ``band`` derives its input from log ρ for these divergence estimators (0: the input as given).
TRANSFORMS = {None: 0, "k1": 1, "k2": 2}
#: Tokens per thread below which a call stays on one thread (a parallel region costs microseconds).
MIN_TOKENS_PER_THREAD = 1 << 16

_DTYPES = {torch.float32: 0, torch.bfloat16: 1}
_state: dict[str, object] = {}
_lock = threading.Lock()


def mode() -> str:
    """The switch ``ROLLOUT_CORRECTION_NATIVE``: "auto", "off" or "on" (see the module docstring)."""
    value = os.environ.get(ENV, "auto").strip().lower()
    if value in ("", "auto"):
        return "auto"
    if value in ("0", "off", "false", "no"):
        return "off"
    if value in ("1", "on", "true", "yes", "required"):
        return "on"
    raise ValueError(f"{ENV}={value!r}: expected auto, 0 or 1")


def _cpu_flags() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith(("flags", "Features")):
                    return line
    except OSError:
        pass
    return platform.processor()


def _cache_dirs() -> list[Path]:
    """Where the library may be built: ``$ROLLOUT_CORRECTION_CACHE``, else the user's cache
    directory, then the system's temporary directory (a read-only home must not disable it)."""
    root = os.environ.get(CACHE_ENV)
    if root:
        return [Path(root)]
    user = os.getuid() if hasattr(os, "getuid") else getpass.getuser()
    return [Path.home() / ".cache" / "rollout_correction",
            Path(tempfile.gettempdir()) / f"rollout_correction-{user}"]  # per user: /tmp is shared


def _private(*paths: Path) -> bool:
    """On POSIX: every path belongs to this user and nobody else can write it. A library is loaded
    only from such a file in such a folder (a shared temporary directory must not let another
    user plant code)."""
    if not hasattr(os, "getuid"):
        return True
    for p in paths:
        st = p.stat()
        if st.st_uid != os.getuid() or st.st_mode & 0o022:
            return False
    return True


def _build() -> ctypes.CDLL:
    source = resources.files(__name__).joinpath("kernels.c").read_bytes()
    cc = os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc") or shutil.which("clang")
    if not cc:
        raise RuntimeError("no C compiler found (set CC, or install gcc)")
    try:
        version = subprocess.run([cc, "--version"], capture_output=True, text=True, timeout=30).stdout
    except (OSError, subprocess.SubprocessError) as e:
        raise RuntimeError(f"the C compiler {cc!r} does not run: {e}") from e
    errors = []
    for extra in VARIANTS:
        flags = FLAGS + extra
        key = hashlib.sha256(b"\0".join([source, cc.encode(), version.encode(), " ".join(flags).encode(),
                                          platform.machine().encode(), _cpu_flags().encode()])).hexdigest()[:16]
        name = f"kernels-{key}.so"
        target = next((d / "native" / name for d in _cache_dirs()
                       if (d / "native" / name).exists() and _private(d / "native" / name, d / "native")), None)
        if target is None:
            try:
                target = _compile(cc, flags, source, name)
            except OSError as e:  # no writable cache directory
                errors.append(str(e))
                continue
            if target is None:
                errors.append(f"{cc} {' '.join(flags)}: {_state.pop('compile_error', '')}")
                continue
        try:
            lib = ctypes.CDLL(str(target))
        except OSError as e:  # e.g. the OpenMP runtime already loaded lacks a symbol version it needs
            errors.append(f"loading {target}: {e}")
            continue
        _declare(lib)
        _state["path"] = str(target)
        _state["openmp"] = bool(lib.rc_openmp())
        return lib
    raise RuntimeError("building the native kernels failed:\n" + "\n".join(errors))


def _compile(cc: str, flags: tuple[str, ...], source: bytes, name: str) -> Optional[Path]:
    """Compile ``source`` into the first writable cache directory; None when the compiler fails
    (its message in ``_state["compile_error"]``)."""
    failure: Optional[OSError] = None
    for root in _cache_dirs():
        folder = root / "native"
        try:
            folder.mkdir(mode=0o700, parents=True, exist_ok=True)
            if not _private(folder):
                raise OSError(f"{folder} is writable by other users (or not this user's)")
            with tempfile.TemporaryDirectory(dir=folder) as tmp:
                src, out = Path(tmp) / "kernels.c", Path(tmp) / name
                src.write_bytes(source)
                run = subprocess.run([cc, *flags, str(src), "-o", str(out), "-lm"], capture_output=True, text=True,
                                     timeout=300)
                if run.returncode != 0:
                    _state["compile_error"] = run.stderr.strip()[-2000:]
                    return None
                out.chmod(0o700)
                os.replace(out, folder / name)  # atomic: concurrent builders each install a complete file
                return folder / name
        except OSError as e:
            failure = e
    raise OSError(f"no writable cache directory for the native kernels ({failure}); set {CACHE_ENV}")


def _declare(lib: ctypes.CDLL) -> None:
    i64, i32, p, f32 = ctypes.c_int64, ctypes.c_int, ctypes.c_void_p, ctypes.c_float
    lib.rc_pass.restype = i32
    lib.rc_pass.argtypes = [i64, i64, p, i64, i32, p, i64, i32, p, i64, i32, i32, p, p, p, p, p, i32,
                            ctypes.c_uint64, p, p, i32, i32]
    lib.rc_openmp.restype = i32
    lib.rc_openmp.argtypes = []
    lib.rc_band.restype = i32
    lib.rc_band.argtypes = [i64, i64, p, p, p, p, f32, f32, f32, f32, f32, f32, i32, i32, i32]


def library() -> Optional[ctypes.CDLL]:
    """The loaded kernels, or None when they are switched off or cannot be built (see module doc)."""
    switch = mode()
    if switch == "off":
        return None
    if "lib" not in _state:
        with _lock:
            if "lib" not in _state:
                try:
                    _state["lib"] = _build()
                except Exception as e:  # no compiler, a failing build, an unloadable library: fall back
                    _state["error"] = f"{type(e).__name__}: {e}"
                    _state["lib"] = None
                    log.info("rollout-correction: native CPU kernels unavailable (%s); using the ATen pass",
                             _state["error"])
    lib = _state["lib"]
    if lib is None and switch == "on":
        raise RuntimeError(f"{ENV}=1 but the native CPU kernels are unavailable: {_state.get('error')}")
    return lib  # type: ignore[return-value]


def status() -> str:
    """One line: whether the kernels are in use, and where they were built or why not."""
    switch = mode()
    if switch == "off":
        return f"native CPU kernels: off ({ENV}=0)"
    try:
        lib = library()
    except RuntimeError as e:
        return f"native CPU kernels: unavailable — {e}"
    if lib is None:
        return f"native CPU kernels: unavailable, using the ATen pass — {_state.get('error')}"
    threads = "OpenMP" if _state.get("openmp") else "POSIX threads"
    return f"native CPU kernels: in use ({_state['path']}; rows split over {threads})"


def _threads(tokens: int) -> int:
    """Threads for a sweep over ``tokens``: PyTorch's intra-op count, at least
    :data:`MIN_TOKENS_PER_THREAD` tokens each. A library built without OpenMP stays on one thread
    when PyTorch's own pool is OpenMP (its spinning workers would hold the cores its threads need)."""
    if not _state.get("openmp") and _torch_uses_openmp():
        return 1
    return max(1, min(torch.get_num_threads(), tokens // MIN_TOKENS_PER_THREAD))


def _torch_uses_openmp() -> bool:
    if "torch_openmp" not in _state:
        _state["torch_openmp"] = "parallel backend: OpenMP" in torch.__config__.parallel_info()
    return bool(_state["torch_openmp"])


def enabled_for(old: torch.Tensor, rollout: torch.Tensor, mask: torch.Tensor) -> bool:
    """Whether :func:`fused_pass` takes these inputs (CPU, float32/bfloat16 log-probs without
    gradient, rows of unit stride) and the kernels are available."""
    if old.device.type != "cpu" or rollout.device.type != "cpu" or mask.device.type != "cpu":
        return False
    if old.dtype not in _DTYPES or rollout.dtype not in _DTYPES or mask.is_complex():
        return False
    if (old.requires_grad or rollout.requires_grad) and torch.is_grad_enabled():
        return False
    if old.dim() != 2 or any(t.shape[-1] > 1 and t.stride(-1) != 1 for t in (old, rollout, mask)):
        return False
    if mask.element_size() not in (1, 2, 4, 8) or (mask.is_floating_point() and mask.dtype not in _FLOAT_ONE):
        return False  # (a float8 mask: its -0.0 is not a zero byte)
    return library() is not None


#: The bit pattern of 1.0 in each floating dtype (an integer 1 for every other dtype).
_FLOAT_ONE = {torch.float16: 0x3C00, torch.bfloat16: 0x3F80, torch.float32: 0x3F800000,
              torch.float64: 0x3FF0000000000000}


def _one_bits(dtype: torch.dtype) -> int:
    """The bit pattern of 1 in ``dtype``, as an unsigned integer."""
    if dtype.is_floating_point and dtype not in _FLOAT_ONE:
        raise TypeError(f"no native mask output for {dtype}")
    return _FLOAT_ONE.get(dtype, 1)


def fused_pass(old: torch.Tensor, rollout: torch.Tensor, mask: torch.Tensor, mask_out: Optional[torch.Tensor],
               log_ratio: Optional[torch.Tensor] = None, ratio: Optional[torch.Tensor] = None,
               k3: Optional[torch.Tensor] = None, keep: Optional[torch.Tensor] = None,
               drop_bad: bool = True) -> tuple[torch.Tensor, torch.Tensor]:
    """One sweep over (B, T) log-probs (see ``kernels.c``): writes the 0/1 mask used into ``mask_out``
    and, when given, log ρ, ρ and k3 ((B, T) float32 contiguous tensors) and the mask used once
    more into ``keep`` (contiguous, any real dtype: 1 and 0 of that dtype); returns the (NSUM, B)
    float32 per-row sums (:data:`PASS_ROWS`) and the (B,) bool "every valid log ρ finite" flags.
    With ``drop_bad`` a row that is not finite is dropped (outputs and sums other than the input
    count 0)."""
    lib = library()
    B, T = old.shape
    sums = torch.empty((len(PASS_ROWS), B), dtype=torch.float32)
    good = torch.empty(B, dtype=torch.bool)
    if B == 0:
        return sums, good
    outs = [log_ratio, mask_out, ratio, k3]
    for o in outs:
        assert o is None or (o.dtype == torch.float32 and o.is_contiguous() and o.shape == old.shape)
    ptrs = [None if o is None else o.data_ptr() for o in outs]
    if keep is not None:
        assert keep.is_contiguous() and keep.shape == old.shape and not keep.is_complex()
        keep_args = (keep.data_ptr(), keep.element_size(), _one_bits(keep.dtype))
    else:
        keep_args = (None, 0, 0)
    lib.rc_pass(B, T, old.data_ptr(), old.stride(0) * old.element_size(), _DTYPES[old.dtype],
                rollout.data_ptr(), rollout.stride(0) * rollout.element_size(), _DTYPES[rollout.dtype],
                mask.data_ptr(), mask.stride(0) * mask.element_size(), mask.element_size(),
                int(mask.is_floating_point()), *ptrs, *keep_args, sums.data_ptr(), good.data_ptr(), int(drop_bad),
                _threads(B * T))
    return sums, good


def band(x: torch.Tensor, mask: torch.Tensor, out: Optional[torch.Tensor], mode: str, lo: float, hi: float,
         wlo: float = 0.0, whi: float = 0.0, zlo: float = 0.0, zhi: float = 0.0,
         transform: Optional[str] = None) -> torch.Tensor:
    """One sweep over a (B, T) float32 value ``x`` (0 where the 0/1 float32 ``mask`` is 0): counts
    above ``hi`` / below ``lo``, writes ``out`` per ``mode`` and returns the (NSTAT, B) float64 per-row
    statistics (:data:`BAND_ROWS`; see ``kernels.c``). With ``transform`` "k1" / "k2", ``x`` is log ρ
    and the value is −clamp(log ρ, ±20) / ½·clamp(log ρ, ±20)²."""
    lib = library()
    B, T = x.shape
    stats = torch.empty((len(BAND_ROWS), B), dtype=torch.float64)
    if B == 0:
        return stats
    assert x.is_contiguous() and mask.is_contiguous() and x.dtype == mask.dtype == torch.float32
    assert out is None or (out.is_contiguous() and out.shape == x.shape and out.dtype == torch.float32)
    lib.rc_band(B, T, x.data_ptr(), mask.data_ptr(), None if out is None else out.data_ptr(), stats.data_ptr(),
                lo, hi, wlo, whi, zlo, zhi, MODES[mode], TRANSFORMS[transform], _threads(B * T))
    return stats
